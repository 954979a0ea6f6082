"""The training-free predictors' basis (predictor.rrr_basis) from the top of an eigenproblem only, and the widths
tried narrowest first until one costs more: the same directions and the same choice as the full search."""

from __future__ import annotations

import numpy as np
import pytest

from pi2_gguf.converter import predictor as pm


def _spectrum_matrix(n: int, alpha: float, rank: int | None = None, seed: int = 0) -> np.ndarray:
    """A symmetric PSD n x n matrix with eigenvalues i^-alpha (a trained gate's squared singular values fall about
    so), the last n - rank of them 0."""
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    lam = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    if rank is not None:
        lam[rank:] = 0.0
    return (q * lam) @ q.T


@pytest.mark.parametrize("alpha, rank", [(0.9, None), (0.3, None), (1.5, 40)])
def test_top_eigenpairs_equal_lapack_s(alpha: float, rank: int | None) -> None:
    s = _spectrum_matrix(400, alpha, rank)
    k = 48
    mu, u = pm._top_eigenpairs(s, k)
    lam, v = np.linalg.eigh(s)
    lam, v = lam[::-1][:k], v[:, ::-1][:, :k]
    assert mu.shape == (k,) and u.shape == (400, k)
    assert np.allclose(mu, lam, rtol=1e-8, atol=1e-12 * lam[0])
    live = lam > 1e-9 * lam[0]  # directions of variance 0 are any basis of their space
    # each direction up to its sign: |u_i . v_i| = 1
    assert np.allclose(np.abs(np.sum(u[:, live] * v[:, live], axis=0)), 1.0, atol=1e-6)
    # a wide request takes LAPACK's path, with the same answer
    mu2, _ = pm._top_eigenpairs(s, 150)
    assert np.allclose(mu2[:k], lam, rtol=1e-10, atol=1e-12 * lam[0])


def test_widths_stop_once_one_costs_more_and_choose_as_the_full_search() -> None:
    rng = np.random.default_rng(1)
    n_embd, n_ff, n_tok = 128, 512, 3000
    gate = (rng.standard_normal((n_ff, 16)) @ rng.standard_normal((16, n_embd)) / 16 +
            0.3 * rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    x = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    xh = rng.standard_normal((500, n_embd)).astype(np.float32)
    g, gh = x @ gate.T, xh @ gate.T
    score = pm.score_fn("relu", lambda z: z)
    costs = pm.Costs(100.0, 300.0)
    ranks = [8, 16, 32, 64, 128]
    fitted = pm.fit_layer(score, 0.5, gate, x, g, xh, gh, ranks, 0.99, costs)
    each = [pm.fit_layer(score, 0.5, gate, x, g, xh, gh, [r], 0.99, costs) for r in ranks]
    full = [f.tried[0] for f in each]
    assert len(fitted.tried) < len(ranks)  # stopped before the widest
    cheapest = min(range(len(ranks)), key=lambda i: full[i][2])
    assert fitted.predictor.rank == each[cheapest].predictor.rank
    for (r, d, c), (r2, d2, c2) in zip(fitted.tried, full):
        assert r == r2 and d == pytest.approx(d2, abs=2e-3) and c == pytest.approx(c2, rel=1e-2)
