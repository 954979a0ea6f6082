"""A minimal PNG encoder (8-bit RGB, zlib from the standard library): enough for heat maps."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_rgb(img: np.ndarray) -> bytes:
    """[height, width, 3] uint8 -> PNG bytes."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"expected [h, w, 3] uint8, got {img.shape} {img.dtype}")
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1)  # filter 0 per row
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + _chunk(b"IEND", b""))


def write_rgb(path: str | Path, img: np.ndarray) -> Path:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(encode_rgb(img))
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


# a perceptual-ish dark-blue -> yellow ramp (viridis anchor points)
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float32)


def colormap(values: np.ndarray) -> np.ndarray:
    """values in [0, 1] -> uint8 RGB."""
    v = np.clip(np.nan_to_num(values), 0.0, 1.0) * (len(_RAMP) - 1)
    i = np.minimum(v.astype(np.int64), len(_RAMP) - 2)
    f = (v - i)[..., None]
    return (_RAMP[i] * (1 - f) + _RAMP[i + 1] * f + 0.5).astype(np.uint8)
