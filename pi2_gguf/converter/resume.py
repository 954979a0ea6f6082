"""convert's work directory: the pieces of finished work a convert keeps so that a rerun resumes where an
interrupted one stopped (docs/CONVERT.md, "Resume").

The directory is `<sidecar>.partial/` beside the output. Each piece (the profile, one layer's plan at one candidate
configuration, one layer's down columns at one reference type, one perplexity score, the calibration date) is an
.npz written to a temporary name, synced and renamed, so a kill leaves either the whole piece or none. A piece is
named by the sha256 of its key, a canonical JSON of everything its result depends on (the model file's identity,
the options that affect it, the keys of the pieces it was computed from, and this module's VERSION), and it holds
that key and a sha256 over its key, its values and its arrays: a piece whose key or digest does not match, or that
cannot be read at all, is deleted and computed again. The directory is removed once the sidecar is written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Pi2Error

# raised whenever what a piece holds, or how its key is formed, changes: pieces of another version are never read
VERSION = 1
SUFFIX = ".partial"
MANIFEST = "work.json"
LOCK = "work.lock"
PIECE = re.compile(r"^(profile|layer|down|ppl|date)-[0-9a-z-]+\.npz$")
TMP = re.compile(r"^\..*\.tmp$")
_META = "__meta__"
_DIGEST = "__digest__"


def key_hash(key: Mapping[str, Any]) -> str:
    """The sha256 of a key's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(canonical(key).encode()).hexdigest()


def canonical(key: Any) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _digest(meta: str, arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def model_identity(path: Path, fingerprint: int) -> dict[str, Any]:
    """What says the model file is the one a piece was computed from: its resolved path, size, modification time
    and the fingerprint of its FFN tensors (docs/FORMAT.md)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "fingerprint": fingerprint}


def file_identity(path: str | Path) -> dict[str, Any]:
    """A file given as an input (a profile, a checkpoint directory): resolved path, size and modification time."""
    p = Path(path)
    st = p.stat()
    return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def work_dir_for(out: Path) -> Path:
    return out.with_name(out.name + SUFFIX)


class WorkDir:
    """The work directory of one convert (open() takes it; close() removes it after the sidecar is written).

    load() and save() take a kind (the file name's prefix), an optional layer and a key dict. Pieces are written
    only after open(); a WorkDir that is not enabled (resume impossible, e.g. an unwritable directory) loads
    nothing and saves nothing."""

    def __init__(self, out: Path, log: Callable[[str], None]) -> None:
        self.path = work_dir_for(out)
        self.log = log
        self.enabled = False
        self.loaded: dict[str, int] = {}    # kind -> pieces reused
        self.computed: dict[str, int] = {}  # kind -> pieces computed and saved
        self.recomputed: list[str] = []     # pieces found unusable: "name (why)"
        self._lock: int | None = None

    def open(self, identity: Mapping[str, Any], fresh: bool) -> str | None:
        """Takes the directory for a convert of the model `identity` names; fresh: drop every piece found. Returns
        why earlier pieces were dropped (None: kept, or there were none)."""
        if self.path.exists() and not self.path.is_dir():
            raise Pi2Error(f"{self.path} is in the way of convert's work directory (not a directory): move it")
        try:
            self.path.mkdir(exist_ok=True)
            self._lock = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self.log(f"no work directory ({self.path}: {e.strerror or e}): this convert cannot be resumed")
            return None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock)
            self._lock = None
            raise Pi2Error(f"another convert is writing {self.path.name.removesuffix(SUFFIX)} (its work directory "
                           f"{self.path} is locked)") from None
        self.enabled = True
        for p in self.path.iterdir():
            if TMP.match(p.name):  # left by a convert killed mid-write
                p.unlink(missing_ok=True)
        want = {"version": VERSION, "model": dict(identity)}
        have: Any = None
        try:
            have = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            pass
        why = None
        pieces = self.pieces()
        if pieces and fresh:
            why = "--no-resume"
        elif pieces and have != want:
            why = ("made by another version of pi2-gguf" if isinstance(have, dict) and have.get("version") != VERSION
                   else "of another model file (or the model file changed)")
        if why is not None:
            for p in pieces:
                p.unlink(missing_ok=True)
        self._write(self.path / MANIFEST, canonical(want).encode())
        return why

    def pieces(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if PIECE.match(p.name)) if self.path.is_dir() else []

    def name(self, kind: str, key: Mapping[str, Any], layer: int | None = None) -> Path:
        at = f"{layer:05d}-" if layer is not None else ""
        return self.path / f"{kind}-{at}{key_hash(key)[:24]}.npz"

    def has(self, kind: str, key: Mapping[str, Any], layer: int | None = None) -> bool:
        return self.enabled and self.name(kind, key, layer).is_file()

    def load(self, kind: str, key: Mapping[str, Any], layer: int | None = None
             ) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """(values, arrays) of the piece saved under key, or None where there is none or it is unusable (then
        deleted, and counted in recomputed)."""
        if not self.enabled:
            return None
        p = self.name(kind, key, layer)
        if not p.is_file():
            return None
        try:
            with np.load(p, allow_pickle=False) as z:
                arrays = {n: z[n] for n in z.files}
            meta = str(arrays.pop(_META)[()])
            digest = str(arrays.pop(_DIGEST)[()])
            if digest != _digest(meta, arrays):
                raise ValueError("its checksum does not match its contents")
            stored = json.loads(meta)
            if stored.get("key") != json.loads(canonical(key)):
                raise ValueError("it was saved for another key")
            values = stored["values"]
            if not isinstance(values, dict):
                raise ValueError("no values")
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises (BadZipFile, EOFError, ...)
            p.unlink(missing_ok=True)
            self.recomputed.append(f"{p.name} ({e})")
            self.log(f"work piece {p.name} is unusable ({e}): computing it again")
            return None
        self.loaded[kind] = self.loaded.get(kind, 0) + 1
        return values, arrays

    def save(self, kind: str, key: Mapping[str, Any], values: Mapping[str, Any],
             arrays: Mapping[str, np.ndarray] | None = None, layer: int | None = None) -> None:
        if not self.enabled:
            return
        arrays = {n: np.ascontiguousarray(a) for n, a in (arrays or {}).items()}
        meta = canonical({"key": json.loads(canonical(key)), "values": dict(values)})
        # Any: numpy's stub would match **members against savez's allow_pickle
        members: dict[str, Any] = {_META: np.array(meta), _DIGEST: np.array(_digest(meta, arrays)), **arrays}
        p = self.name(kind, key, layer)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as f:
                np.savez(f, **members)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(p)
        except OSError as e:  # a full disk: the convert goes on, this piece is just not kept
            tmp.unlink(missing_ok=True)
            self.log(f"work piece {p.name} not kept ({e.strerror or e}): a resume would compute it again")
            return
        self.computed[kind] = self.computed.get(kind, 0) + 1

    def _write(self, p: Path, data: bytes) -> None:
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            tmp.replace(p)
        except OSError:
            tmp.unlink(missing_ok=True)

    def close(self, remove: bool) -> None:
        """Releases the directory; remove: deletes every file convert put there, then the directory (left where
        anything else is in it)."""
        if remove and self.path.is_dir():
            for p in self.path.iterdir():
                if PIECE.match(p.name) or TMP.match(p.name) or p.name in (MANIFEST, LOCK):
                    p.unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:
                pass
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        self.enabled = False
