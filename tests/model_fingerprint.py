"""A GGUF model's content, compared up to the last bits of floating point: each tensor's name, type, shape and the
mean and spread of its values, and every metadata value but floats exactly. make_model calibrates through
llama.cpp, whose sums round differently on another CPU (AVX-512 against AVX2 kernels), so the bytes of one
generator's output differ from machine to machine while what it made does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

# (type name, shape, mean, standard deviation) per tensor
Fingerprint = dict[str, tuple[str, tuple[int, ...], float, float]]


def fingerprint(path: Path) -> tuple[Fingerprint, dict[str, object]]:
    """Each tensor's (type, shape, mean, std) and each non-float metadata value (floats are calibration results)."""
    r = GGUFReader(path)
    tensors: Fingerprint = {}
    for t in r.tensors:
        v = dequantize(t.data, t.tensor_type).astype(np.float64)
        tensors[t.name] = (t.tensor_type.name, tuple(int(x) for x in t.shape), float(v.mean()), float(v.std()))
    meta: dict[str, object] = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or GGUFValueType.FLOAT32 in f.types or GGUFValueType.FLOAT64 in f.types:
            continue
        meta[name] = f.contents()
    return tensors, meta


def assert_same_model(path: Path, tensors: Fingerprint, meta_sha256: str, rel: float = 1e-4) -> None:
    """path holds the model fingerprinted as `tensors` (means within rel of the spread, spreads within rel) with
    metadata whose non-float values hash to meta_sha256."""
    import hashlib

    got, meta = fingerprint(path)
    assert sorted(got) == sorted(tensors), sorted(set(got) ^ set(tensors))
    for name, (qt, shape, mean, std) in tensors.items():
        g_qt, g_shape, g_mean, g_std = got[name]
        assert (g_qt, g_shape) == (qt, shape), (name, g_qt, g_shape)
        assert abs(g_mean - mean) <= rel * max(std, 1e-12) and abs(g_std - std) <= rel * max(std, 1e-12), \
            (name, g_mean, mean, g_std, std)
    assert hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest() == meta_sha256


def describe(path: Path) -> str:
    """The literal a test records (tensors, metadata hash) for path."""
    import hashlib

    tensors, meta = fingerprint(path)
    lines = ["{"] + [f"    {n!r}: ({q!r}, {s!r}, {m!r}, {d!r})," for n, (q, s, m, d) in sorted(tensors.items())] + ["}"]
    return "\n".join(lines) + "\n" + hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()
