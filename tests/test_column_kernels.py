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
