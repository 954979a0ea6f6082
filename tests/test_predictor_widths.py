"""The predictor widths tried narrowest first until one costs more: the same choice as trying them all."""

from __future__ import annotations

import numpy as np
import pytest

from pi2_gguf.converter import predictor as pm


def test_widths_stop_once_one_costs_more_and_choose_as_the_full_search() -> None:
    rng = np.random.default_rng(1)
    n_embd, n_ff, n_tok = 128, 512, 3000
    gate = (rng.standard_normal((n_ff, 16)) @ rng.standard_normal((16, n_embd)) / 16 +
            0.3 * rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    x = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    xh = rng.standard_normal((500, n_embd)).astype(np.float32)
    g, gh = x @ gate.T, xh @ gate.T
    score = pm.score_fn("relu", lambda z: z)
    costs = pm.Costs(400.0)
    ranks = [8, 16, 32, 64, 128]
    fitted = pm.fit_layer(score, 0.5, gate, x, g, xh, gh, ranks, 0.99, costs)
    each = [pm.fit_layer(score, 0.5, gate, x, g, xh, gh, [r], 0.99, costs) for r in ranks]
    full = [f.tried[0] for f in each]
    assert len(fitted.tried) < len(ranks)  # stopped before the widest
    cheapest = min(range(len(ranks)), key=lambda i: full[i][2])
    assert fitted.predictor.rank == each[cheapest].predictor.rank
    for (r, d, c), (r2, d2, c2) in zip(fitted.tried, full):
        assert r == r2 and d == pytest.approx(d2, abs=2e-3) and c == pytest.approx(c2, rel=1e-2)
