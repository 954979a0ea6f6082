"""The down-column kernels of sparse decode (also the predictor's output layer): y += sum a_c * column_c,
four columns per SIMD pass, against numpy on the columns as gguf-py dequantizes them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pi2_gguf.converter import bundles
from pi2_gguf.runtime import native


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.Q3_K, QT.F16, QT.F32, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("n_cols", [1, 4, 7, 13])
def test_column_sums_match_numpy(qtype: QT, n_cols: int) -> None:
    rng = np.random.default_rng(n_cols)
    n = 512
    cols_f = rng.standard_normal((n_cols, n)).astype(np.float32)
    q = bundles.quantize_rows(qtype, cols_f)
    deq = bundles.dequantize_rows(qtype, q, n).astype(np.float64)
    a = rng.standard_normal(n_cols).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32)
    want = y0.astype(np.float64) + a.astype(np.float64) @ deq
    y = y0.copy()
    native.columns_add(int(qtype), y, a, q)
    scale = np.abs(a).sum() * np.abs(deq).max() + np.abs(y0).max()
    assert np.abs(y - want).max() <= 1e-5 * scale, np.abs(y - want).max() / scale


def test_column_sum_refuses_a_length_off_the_block_size() -> None:
    q = bundles.quantize_rows(QT.Q4_K, np.ones((1, 256), dtype=np.float32))
    with pytest.raises(ValueError, match="no column kernel"):
        native.columns_add(int(QT.Q4_K), np.zeros(255, dtype=np.float32), np.ones(1), q)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.Q3_K, QT.F16, QT.F32, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("n_tokens", [1, 4, 7, 32])
def test_batch_column_sums_match_numpy(qtype: QT, n_tokens: int) -> None:
    """A prompt batch's down (columns dequantized once, added four tokens at a time): each token's sum of its own
    weights times the columns, a column no token uses (weights 0) or none computed (None) adding nothing; n of 544
    leaves a tail past the SIMD width's 2 x 16."""
    rng = np.random.default_rng(n_tokens)
    n, n_cols = 544 if qtype not in (QT.Q4_K, QT.Q6_K, QT.Q3_K) else 512, 29
    cols_f = rng.standard_normal((n_cols, n)).astype(np.float32)
    q = bundles.quantize_rows(qtype, cols_f)
    deq = bundles.dequantize_rows(qtype, q, n).astype(np.float64)
    a = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
    a[rng.random((n_tokens, n_cols)) < 0.3] = 0.0  # each token its own columns
    a[:, 3] = 0.0                                  # no token's
    columns: list[np.ndarray | None] = [q[c] for c in range(n_cols)]
    columns[5] = None                              # not computed: its weights are ignored
    deq[5] = 0.0
    y0 = rng.standard_normal((n_tokens, n)).astype(np.float32)
    want = y0.astype(np.float64) + a.astype(np.float64) @ deq
    y = y0.copy()
    native.columns_add_batch(int(qtype), y, a, columns)
    scale = np.abs(a).sum(axis=1, keepdims=True) * np.abs(deq).max() + np.abs(y0).max()
    assert (np.abs(y - want) <= 1e-5 * scale).all(), (np.abs(y - want) / scale).max()
    # one token through the batch kernel is that token's own sum (rows do not mix)
    y1 = y0[:1].copy()
    native.columns_add_batch(int(qtype), y1, a[:1], columns)
    assert np.array_equal(y1[0], y[0])


def test_batch_column_sum_refuses_more_columns_than_a_cluster() -> None:
    q = bundles.quantize_rows(QT.Q8_0, np.ones((33, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="no batch column kernel"):
        native.columns_add_batch(int(QT.Q8_0), np.zeros((2, 32), dtype=np.float32), np.ones((2, 33)), list(q))
