"""Synthetic models' iid Gaussian weight matrices, written straight in a 4-bit type.

A synthetic model's up and down matrices are iid N(0, sigma^2) draws that nothing calibrates; drawing them in
float32 and quantizing them with ggml's reference quantizer cost ~80 ns a weight here (Q4_K: the quantizer's
search), most of the time a 17 GB MoE model took to make. Drawn as 4-bit codes instead, each code is the
popcount of 15 (Q4_K) or 16 (Q4_0) random bits: a binomial, bell-shaped around the middle of the 4-bit range, with
one scale for all blocks so that the values' standard deviation is sigma. ~3 ns a weight. The values llama.cpp
computes with are then exactly the codes times the scale: the model is what it was meant to be (iid, zero mean,
variance sigma^2), on a 16-level grid as any 4-bit model's weights are. Other types draw float32 and quantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

# the popcount of n random bits has standard deviation sqrt(n) / 2
_Q4_K_BITS = 15   # codes 0..15, mean 7.5: value = step * (code - 7.5), Q4_K's d * scale * q - dmin * min
_Q4_0_BITS = 16   # codes 0..16 (16 clipped to 15, p = 2^-16), mean 8: value = d * (code - 8), Q4_0's
DIRECT_TYPES = (QT.Q4_K, QT.Q4_0)


@dataclass(frozen=True)
class GaussianMatrix:
    """A matrix (or a stack of them: shape [n, rows, k]) of iid N(0, sigma^2) weights not drawn yet, the first
    zero_rows rows of each matrix zero (the dimensions a synthetic FFN never writes). seed: numpy's seed sequence
    for the draws (values() draws floats, quantized() codes: the same distribution, not the same numbers)."""

    shape: tuple[int, ...]
    sigma: float
    seed: tuple[int, ...]
    zero_rows: int = 0

    def values(self) -> np.ndarray:
        """The weights as float32 draws (the path of the types not written directly)."""
        rng = np.random.default_rng(list(self.seed))
        a = rng.standard_normal(self.shape, dtype=np.float32)
        a *= np.float32(self.sigma)
        a[..., :self.zero_rows, :] = 0.0
        return a

    def quantized(self, qtype: QT) -> np.ndarray:
        """The weights as qtype's blocks, [*shape[:-1], row bytes] uint8 (qtype one of DIRECT_TYPES)."""
        if qtype not in DIRECT_TYPES:
            raise ValueError(f"{qtype.name} is not written directly; use values()")
        k = self.shape[-1]
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise ValueError(f"rows of {k} are not a whole number of {qtype.name} blocks of {block}")
        n_rows = int(np.prod(self.shape[:-1]))
        nb = k // block
        out = np.empty((n_rows, nb, block_bytes), np.uint8)
        rng = np.random.default_rng(list(self.seed))
        bits = _Q4_K_BITS if qtype == QT.Q4_K else _Q4_0_BITS
        step = self.sigma / (np.sqrt(bits) / 2.0)
        if qtype == QT.Q4_K:
            # every sub-block's 6-bit scale and min 63 (all twelve scale bytes 0xFF): value = d*63*q - dmin*63
            head = np.array([step / 63.0, 7.5 * step / 63.0], np.float16).view(np.uint8)
            out[:, :, 0:4] = head
            out[:, :, 4:16] = 0xFF
            qs = slice(16, block_bytes)
        else:
            out[:, :, 0:2] = np.array([step], np.float16).view(np.uint8)
            qs = slice(2, block_bytes)
        n_q = block_bytes - qs.start  # code bytes a block: two codes each, which code goes where does not matter (iid)
        mask = np.uint16((1 << bits) - 1)
        rows_at = max(1, (1 << 22) // (nb * n_q))  # ~4 MB of codes at a time: the temporaries stay small
        for r0 in range(0, n_rows, rows_at):
            r1 = min(n_rows, r0 + rows_at)
            n_codes = (r1 - r0) * nb * n_q * 2
            raw = rng.bit_generator.random_raw((n_codes + 3) // 4).view(np.uint16)[:n_codes]
            codes = np.bitwise_count(raw & mask).astype(np.uint8)
            np.minimum(codes, 15, out=codes)
            out[r0:r1, :, qs] = (codes[0::2] | (codes[1::2] << 4)).reshape(r1 - r0, nb, n_q)
        if self.zero_rows:  # zero scales: those rows' values are 0 whatever the codes
            view = out.reshape(-1, self.shape[-2], nb, block_bytes)
            view[:, :self.zero_rows, :, :4 if qtype == QT.Q4_K else 2] = 0
        return out.reshape(*self.shape[:-1], nb * block_bytes)


Weight = np.ndarray | GaussianMatrix  # a synthetic layer's tensor: drawn, or drawn when written


def as_array(a: Weight) -> np.ndarray:
    """a's values as float32 (a GaussianMatrix drawn)."""
    return a.values() if isinstance(a, GaussianMatrix) else a
