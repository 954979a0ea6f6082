"""Synthetic models' iid Gaussian up and down matrices written straight as 4-bit codes (gaussian_weights): the values
llama.cpp computes with have the asked mean, spread and zero rows, in the model file as make_model writes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from pi2_gguf.assets import models
from pi2_gguf.converter import bundles, synthetic, synthetic_moe
from pi2_gguf.converter.gaussian_weights import DIRECT_TYPES, GaussianMatrix


@pytest.mark.parametrize("qtype", DIRECT_TYPES)
def test_codes_have_the_asked_distribution(qtype: QT) -> None:
    g = GaussianMatrix((3, 96, 1024), 0.03, (7, 1), zero_rows=5)
    q = g.quantized(qtype)
    assert q.shape == (3, 96, bundles.fmt.row_size(qtype, 1024)) and q.dtype == np.uint8
    v = bundles.dequantize_rows(qtype, q.reshape(-1, q.shape[-1]), 1024).reshape(3, 96, 1024)
    assert not v[:, :5].any()
    rest = v[:, 5:].astype(np.float64)
    assert abs(rest.mean()) < 0.01 * 0.03 and rest.std() == pytest.approx(0.03, rel=0.01)
    assert len(np.unique(rest)) == 16  # a 4-bit grid, every level used
    # the levels' shares: a binomial's bell, not flat
    counts = np.unique(rest, return_counts=True)[1] / rest.size
    assert counts[7] + counts[8] > 0.35 and counts[0] + counts[15] < 0.002
    assert np.array_equal(q, g.quantized(qtype))  # a seed gives the same weights
    assert not np.array_equal(q, GaussianMatrix(g.shape, g.sigma, (7, 2), 5).quantized(qtype))


def test_other_types_draw_floats() -> None:
    g = GaussianMatrix((64, 256), 0.5, (3,), zero_rows=2)
    v = g.values()
    assert v.dtype == np.float32 and not v[:2].any() and v[2:].std() == pytest.approx(0.5, rel=0.03)
    data, _, qt = synthetic.as_tensor(g, QT.Q8_0)
    assert qt == QT.Q8_0 and data.shape == (64, bundles.fmt.row_size(QT.Q8_0, 256))
    with pytest.raises(ValueError, match="Q8_0 is not written directly"):
        g.quantized(QT.Q8_0)
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        GaussianMatrix((4, 100), 1.0, (0,)).quantized(QT.Q4_K)


def test_real_moe_in_q4_k_writes_up_and_down_as_codes(tmp_path: Path) -> None:
    """stats real in Q4_K: the experts' up and down in the file have the spread layer() asks (1 / sqrt(n_embd) and
    1 / sqrt(n_ff density)) and down's first 1 + n_ctx_dims rows zero; stats real in F32 keeps every earlier model's
    draws (the tiny models tests compare byte for byte)."""
    shape = synthetic_moe.MoeShape(n_embd=256, n_ff=256, n_layer=1, n_head=2, n_head_kv=1, n_expert=4, n_expert_used=2)
    tok = synthetic._tokenizer_fields(GGUFReader(models.fetch(models.DEFAULT_MODEL, False), "r"))
    sp = synthetic.Sparsity(density=0.25, stats="real")
    w = synthetic_moe._MoeWeights(shape, sp, synthetic_moe.Routing(), "silu", 0.0, synthetic._n_vocab(tok), 0)
    w.codes = True
    path = synthetic_moe.write_moe_model(tmp_path / "q.gguf", w, tok, "qwen3moe", QT.Q4_K, "m", progress=False)
    t = {x.name: x for x in GGUFReader(path, "r").tensors}
    up, down = t["blk.0.ffn_up_exps.weight"], t["blk.0.ffn_down_exps.weight"]
    assert up.tensor_type == down.tensor_type == QT.Q4_K
    u = bundles.dequantize_rows(QT.Q4_K, np.asarray(up.data).reshape(-1, 144), 256)
    d = bundles.dequantize_rows(QT.Q4_K, np.asarray(down.data).reshape(-1, 144), 256).reshape(4, 256, 256)
    assert u.std() == pytest.approx(1 / 16, rel=0.02)
    m = w.n_ctx_dims
    assert not d[:, :1 + m].any() and d[:, 1 + m:].std() == pytest.approx(1 / np.sqrt(256 * 0.25), rel=0.02)
    w.codes = False
    assert isinstance(w.layer(0, "qwen3moe")["ffn_up_exps"], np.ndarray)
