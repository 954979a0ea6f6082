"""Up-front validation of GGUF files, so bad input gets a clear error instead of a loader failure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from .errors import ModelFileError, Pi2Error

GGUF_MAGIC = b"GGUF"


def open_gguf(path: str | Path, what: str, error: type[Pi2Error]) -> tuple[Path, GGUFReader]:
    """Opens a GGUF file with gguf-py, checking that it exists, is GGUF, parses, and holds all of its
    tensors; each failure raises `error` with a message naming the file as `what` ("model file")."""
    p = Path(path).expanduser()
    if not p.exists():
        raise error(f"{what} not found: {p}")
    if not p.is_file():
        raise error(f"{what} path is not a file: {p}")
    size = p.stat().st_size
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise error(f"{what} {p} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(p, "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError) as e:
        raise error(f"{what} {p} is a corrupt or truncated GGUF file ({size} bytes): {e}") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise error(f"{what} {p} is truncated: tensor {t.name} ends at byte {end}, the file has {size}")
    return p, reader


def check_model_file(path: str | Path) -> Path:
    """Returns the resolved path of a readable, complete GGUF file, or raises ModelFileError."""
    p, reader = open_gguf(path, "model file", ModelFileError)
    if len(reader.tensors) == 0:
        raise ModelFileError(f"{p} holds no tensors")
    del reader
    return p.resolve()


def read_architecture(path: str | Path) -> str:
    reader = GGUFReader(Path(path), "r")
    field = reader.get_field("general.architecture")
    if field is None:
        raise ModelFileError(f"{path} has no general.architecture")
    return bytes(np.asarray(field.parts[field.data[0]])).decode()
