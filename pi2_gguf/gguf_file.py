"""Up-front validation of GGUF files, so bad input gets a clear error instead of a loader failure."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader

from .errors import ModelFileError, Pi2Error
from .runtime.native import ModelSummary, model_summary_c

GGUF_MAGIC = b"GGUF"


def _gguf_path(path: str | Path, what: str, error: type[Pi2Error]) -> Path:
    """The path of an existing file that starts with the GGUF magic, or `error` naming the file as `what`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise error(f"{what} not found: {p}")
    if not p.is_file():
        raise error(f"{what} path is not a file: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise error(f"{what} {p} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return p


def open_gguf(path: str | Path, what: str, error: type[Pi2Error]) -> tuple[Path, GGUFReader]:
    """Opens a GGUF file with gguf-py, checking that it exists, is GGUF, parses, and holds all of its
    tensors; each failure raises `error` with a message naming the file as `what` ("model file")."""
    p = _gguf_path(path, what, error)
    size = p.stat().st_size
    try:
        reader = GGUFReader(p, "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError) as e:
        raise error(f"{what} {p} is a corrupt or truncated GGUF file ({size} bytes): {e}") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise error(f"{what} {p} is truncated: tensor {t.name} ends at byte {end}, the file has {size}")
    return p, reader


def read_model_file(path: str | Path) -> tuple[Path, ModelSummary]:
    """The resolved path of a readable, complete GGUF model and the plugin's summary of it (FFN fingerprint and
    sizes), or ModelFileError. The header is read by ggml's reader in the plugin, not gguf-py's: that one
    builds Python objects for every vocabulary entry (~500 MB for Qwen2.5's 151,936), and what it leaves
    resident a memory budget would take from the neuron cache."""
    p = _gguf_path(path, "model file", ModelFileError)
    summary = model_summary_c(p)
    if summary.n_tensors == 0:
        raise ModelFileError(f"{p} holds no tensors")
    return p.resolve(), summary


def check_model_file(path: str | Path) -> Path:
    """Returns the resolved path of a readable, complete GGUF file, or raises ModelFileError."""
    return read_model_file(path)[0]
