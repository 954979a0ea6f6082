"""Up-front validation of GGUF files, so bad input gets a clear error instead of a loader failure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"


def check_model_file(path: str | Path) -> Path:
    """Returns the resolved path of a readable, complete GGUF file, or raises ModelFileError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"model path is not a file: {p}")
    size = p.stat().st_size
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {p}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(p, "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError) as e:
        raise ModelFileError(f"{p} is a corrupt or truncated GGUF file ({size} bytes): {e}") from e
    end = 0
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
    if end > size:
        raise ModelFileError(f"{p} is truncated: its tensors need {end} bytes, the file has {size}")
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
