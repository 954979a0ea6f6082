"""An MoE profile per sidecar layer (Profile.experts): each expert gets the inputs of the tokens routed to it, and the
experts read whole from the model file (nothing planned for them) get none instead of a copy."""

from __future__ import annotations

import numpy as np

from pi2_gguf.converter.profile import MIN_ROUTED, Profile


def test_expert_views_and_skipped_experts() -> None:
    rng = np.random.default_rng(0)
    n_tok, n_embd, n_expert, k = 400, 8, 4, 2
    x = [rng.standard_normal((n_tok, n_embd)).astype(np.float16) for _ in range(2)]
    routes = [np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok)]).astype(np.int16) for _ in range(2)]
    routes[1][:, :] = [0, 1]  # layer 1: experts 2 and 3 never routed, so profiled on every token
    p = Profile("m.gguf", 1, "c", "0" * 64, 64, x, [a[:100] for a in x], routes, [r[:100] for r in routes])
    full = p.experts([n_expert, n_expert], n_expert)
    assert full.n_layer == 2 * n_expert and full.n_train == n_tok and full.n_embd == n_embd
    for e in range(n_expert):
        rows = (routes[0] == e).any(axis=1)
        assert rows.sum() >= MIN_ROUTED and np.array_equal(full.train[e], x[0][rows])
    assert np.array_equal(full.train[n_expert + 2], x[1]) and np.array_equal(full.train[n_expert], x[1])
    skipped = p.experts([n_expert, n_expert], n_expert, frozenset({1, 5, 6}))
    for il in range(2 * n_expert):
        if il in (1, 5, 6):
            assert skipped.train[il].shape == (0, n_embd) and skipped.heldout[il].shape == (0, n_embd)
        else:
            assert np.array_equal(skipped.train[il], full.train[il])
            assert np.array_equal(skipped.heldout[il], full.heldout[il])
    assert skipped.expert_share == full.expert_share and skipped.expert_reuse == full.expert_reuse
    assert skipped.n_embd == n_embd and skipped.n_train == n_tok
