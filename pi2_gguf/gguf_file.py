"""Up-front validation of GGUF files, so bad input gets a clear error instead of a loader failure."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .errors import ModelFileError, Pi2Error
from .paths import read_head
from .runtime.native import ModelSummary, model_summary_c
from .sidecar import format as fmt

GGUF_MAGIC = b"GGUF"


def _gguf_path(path: str | Path, what: str, error: type[Pi2Error]) -> Path:
    """The path of an existing file that starts with the GGUF magic, or `error` naming the file as `what`."""
    p, magic = read_head(path, what, error)
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


# GGUF value types (gguf.GGUFValueType) of fixed size: struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    qtype: int
    shape: list[int]     # ggml order (ne0 first)
    n_bytes: int


def _walk_header(f: BinaryIO, wanted: set[str], max_keys: int | None,
                 tensors: bool) -> tuple[dict[str, str | int | float], list[TensorInfo]]:
    """The scalar and string values of the wanted keys among the first max_keys keys (None: all) of the GGUF file f,
    and with `tensors` every tensor's name, type, shape and size; EOFError or ValueError where the header is
    truncated or malformed. Reads the header alone: gguf-py would build every vocabulary entry first."""
    def take(fmt_: str) -> tuple:
        size = struct.calcsize("<" + fmt_)
        raw = f.read(size)
        if len(raw) != size:
            raise EOFError
        return struct.unpack("<" + fmt_, raw)

    def string() -> str:
        (n,) = take("Q")
        if n > 1 << 16:
            raise EOFError
        return f.read(n).decode("utf-8", "replace")

    def skip(vtype: int) -> None:
        if vtype in _SCALARS:
            f.seek(struct.calcsize("<" + _SCALARS[vtype]), os.SEEK_CUR)
        elif vtype == _STRING:
            f.seek(take("Q")[0], os.SEEK_CUR)
        elif vtype == _ARRAY:
            etype, n = take("IQ")
            if etype in _SCALARS:
                f.seek(n * struct.calcsize("<" + _SCALARS[etype]), os.SEEK_CUR)
            else:
                for _ in range(n):
                    skip(etype)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    found: dict[str, str | int | float] = {}
    magic, _version, n_tensors, n_kv = take("4sIQQ")
    if magic != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    for _ in range(n_kv if max_keys is None else min(n_kv, max_keys)):
        key = string()
        (vtype,) = take("I")
        if key in wanted and vtype == _STRING:
            (n,) = take("Q")
            found[key] = f.read(min(n, 1 << 16)).decode("utf-8", "replace")
            f.seek(max(n - (1 << 16), 0), os.SEEK_CUR)  # past the rest of a longer value: the next key follows it
        elif key in wanted and vtype in _SCALARS:
            found[key] = take(_SCALARS[vtype])[0]
        else:
            skip(vtype)
        if not tensors and len(found) == len(wanted):
            break
    infos: list[TensorInfo] = []
    for _ in range(n_tensors if tensors else 0):
        name = string()
        (nd,) = take("I")
        shape = [int(x) for x in take("Q" * nd)] if nd else []
        qtype, _offset = take("IQ")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        infos.append(TensorInfo(name, int(qtype), shape, math.prod(shape) // block * type_size))
    return found, infos


def _header_values(path: str | Path, wanted: set[str], max_keys: int = 128) -> dict[str, str | int | float]:
    """The scalar and string values of the wanted keys among a GGUF file's first max_keys keys, read from its
    header alone; {} if the header is malformed."""
    try:
        with open(path, "rb") as f:
            return _walk_header(f, wanted, max_keys, tensors=False)[0]
    except (OSError, EOFError, ValueError, struct.error):
        return {}


def header_tensors(path: Path, wanted: set[str]) -> tuple[dict[str, str | int | float], list[TensorInfo]]:
    """The wanted keys' scalar and string values and every tensor's name, type, shape and size, from a GGUF file's
    header alone (gguf-py's reader builds an object per vocabulary entry, hundreds of MB for a large vocabulary);
    ModelFileError naming the file where the header is truncated or malformed."""
    try:
        with open(path, "rb") as f:
            return _walk_header(f, wanted, None, tensors=True)
    except (EOFError, struct.error):
        raise ModelFileError(f"model file {path}: truncated header") from None
    except ValueError as e:
        raise ModelFileError(f"model file {path}: {e}") from None
    except OSError as e:
        raise ModelFileError(f"model file {path}: {e.strerror or e}") from None


def gguf_architecture(path: str | Path) -> str | None:
    """general.architecture of a GGUF file, from its header (None if it is not among the first keys)."""
    arch = _header_values(path, {"general.architecture"}).get("general.architecture")
    return arch if isinstance(arch, str) else None


def expert_used_count(path: str | Path) -> int:
    """<arch>.expert_used_count of an MoE model from its header, 0 for a model that states none."""
    arch = gguf_architecture(path)
    key = f"{arch}.expert_used_count"
    n = _header_values(path, {key}).get(key) if arch else None
    return int(n) if isinstance(n, int) else 0


def load_failure(path: Path) -> ModelFileError:
    """The error for a GGUF llama.cpp refused to load (its log, silent unless verbose, says why)."""
    return ModelFileError(f"llama.cpp could not load model file {path} (general.architecture "
                          f"'{gguf_architecture(path)}': an architecture llama.cpp supports, with all its keys and "
                          "tensors?)")


def check_context(path: Path, n_ctx: int | None, option: str, default: int = 0) -> int:
    """The context size to load a model with: n_ctx, refused if longer than the model was trained for
    (<arch>.context_length: llama.cpp would only warn of a 'possible training context overflow', and at sizes
    like 10^8 fail to allocate its KV cache); None: default, or the trained length if that is shorter."""
    arch = gguf_architecture(path)
    key = f"{arch}.context_length"
    trained = _header_values(path, {key}).get(key) if arch else None
    trained = trained if isinstance(trained, int) and trained > 0 else None
    if n_ctx is None:
        return min(default, trained) if trained else default
    if trained and n_ctx > trained:
        raise Pi2Error(f"{option} {n_ctx}: more than the {trained} tokens {path.name} was trained for ({key})")
    return n_ctx


def read_model_file(path: str | Path) -> tuple[Path, ModelSummary]:
    """The path of a readable, complete GGUF model, as given (absolute, symbolic links kept: the model's
    default sidecar is the one beside the path the user named), and the plugin's summary of it (FFN
    fingerprint and sizes), or ModelFileError. The header is read by ggml's reader in the plugin, not
    gguf-py's: that one builds Python objects for every vocabulary entry (~500 MB for Qwen2.5's 151,936), and
    what it leaves resident a memory budget would take from the neuron cache."""
    p = _gguf_path(path, "model file", ModelFileError)
    if gguf_architecture(p) == fmt.ARCHITECTURE:
        raise ModelFileError(f"model file {p} is a pi2 sidecar, not a model; give the model it was made for "
                             "(and the sidecar with --sidecar)")
    summary = model_summary_c(p)
    if summary.n_tensors == 0:
        raise ModelFileError(f"model file {p} holds no tensors")
    return p.absolute(), summary


def check_model_file(path: str | Path) -> Path:
    """Returns the path (absolute, symbolic links kept) of a readable, complete GGUF model, or raises
    ModelFileError."""
    return read_model_file(path)[0]
