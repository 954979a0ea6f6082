"""A prompt batch's gate and up rows dotted with several tokens a call (dense/dot_tokens.c): each token's value is
ggml-cpu's vec_dot's bit for bit, so a batch computes what decode computes token by token."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pi2_gguf.converter import bundles
from pi2_gguf.runtime import native


def _has_avx2() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


def _rows_and_tokens(n: int, n_rows: int, n_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # rows of varied scale, one all zero; tokens of varied scale too (the blocks' scales and mins all differ)
    w = rng.standard_normal((n_rows, n)).astype(np.float32) * rng.uniform(0.01, 3.0, (n_rows, 1)).astype(np.float32)
    w[0] = 0.0
    w[1] += 0.5  # a row whose blocks have non-zero mins
    x = rng.standard_normal((n_tokens, n)).astype(np.float32) * rng.uniform(0.1, 10.0, (n_tokens, 1)).astype(np.float32)
    return w, x


@pytest.mark.parametrize(("qtype", "n"), [(QT.Q4_K, 256), (QT.Q4_K, 1536), (QT.Q4_K, 4096), (QT.Q4_1, 576),
                                          (QT.Q4_1, 1536), (QT.Q4_1, 4096)])
@pytest.mark.parametrize("n_tokens", [1, 4, 7, 13])
def test_kernel_tokens_equal_vec_dot_bit_for_bit(qtype: QT, n: int, n_tokens: int) -> None:
    w, x = _rows_and_tokens(n, 9, n_tokens, n + n_tokens)
    q = bundles.quantize_rows(qtype, w)
    got, used = native.dot_rows_tokens(int(qtype), q, x, kernel=True)
    want, used_ref = native.dot_rows_tokens(int(qtype), q, x, kernel=False)
    assert not used_ref
    # this machine's build has the kernel (x86 with AVX2): it must be the one that ran
    assert used == (_has_avx2() and n_tokens >= 4)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # and a dot product it is: against the rows as gguf-py dequantizes them, the tokens unrounded
    deq = bundles.dequantize_rows(qtype, q, n).astype(np.float64)
    exact = x.astype(np.float64) @ deq.T
    scale = np.abs(x).max(axis=1, keepdims=True) * np.abs(deq).sum(axis=1)[None, :] + 1e-30
    assert np.all(np.abs(got - exact) <= 2e-2 * scale)


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_0, QT.Q8_0, QT.F16])
def test_types_without_a_kernel_take_vec_dot(qtype: QT) -> None:
    w, x = _rows_and_tokens(512, 5, 8, int(qtype))
    q = bundles.quantize_rows(qtype, w)
    got, used = native.dot_rows_tokens(int(qtype), q, x, kernel=True)
    want, _ = native.dot_rows_tokens(int(qtype), q, x, kernel=False)
    assert not used
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_rows_of_another_length_are_refused() -> None:
    q = bundles.quantize_rows(QT.Q4_K, np.ones((2, 512), dtype=np.float32))
    with pytest.raises(ValueError, match="not rows of"):
        native.dot_rows_tokens(int(QT.Q4_K), q, np.ones((4, 256), dtype=np.float32))
