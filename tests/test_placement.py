"""Which FFN layers PI2 holds in RAM (docs/BACKEND.md, "Which layers PI2 holds"): by default (PI2_LAYERS=auto)
a layer PI2 would not decode faster than ggml-cpu is left to ggml-cpu's buffers and kernels, so it runs exactly
as stock llama.cpp runs it, repacked weights included. The rest of the suite holds every layer (conftest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pi2_gguf
from pi2_gguf.errors import PluginError
from pi2_gguf.runtime.isolated import greedy_in_subprocess

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
AUTO = {"layers": "auto"}


def test_left_layers_run_exactly_as_stock(smollm2: Path, smol_sidecar: Path) -> None:
    """SmolLM2 without a sidecar (dense) and with its 50% sidecar in predicted mode (0.49 active in every
    layer: sparse decode would read about as many bytes, through slower kernels) is left to ggml-cpu: the
    logits of stock llama.cpp with its defaults (repacked weights), bit for bit, and no FFN work in PI2."""
    stock = greedy_in_subprocess(smollm2, PROMPTS, 8, pi2=False)
    for sidecar, mode in ((None, None), (smol_sidecar, "predicted"), (smol_sidecar, "dense")):
        mine = greedy_in_subprocess(smollm2, PROMPTS, 8, pi2=True, sidecar=sidecar, mode=mode, settings=AUTO)
        for s, m in zip(stock, mine):
            assert np.array_equal(np.array(m.logits_first), np.array(s.logits_first)), (sidecar, mode)
            assert m.tokens == s.tokens
            assert m.pi2_matmuls == 0, (sidecar, mode)


def test_held_layers_still_run_in_pi2(smollm2: Path, smol_sidecar: Path) -> None:
    """With PI2_LAYERS=all the same load runs every FFN matmul in PI2; oracle mode holds every layer."""
    for settings, mode in (({"layers": "all"}, "predicted"), (AUTO, "oracle")):
        mine = greedy_in_subprocess(smollm2, PROMPTS[:1], 4, pi2=True, sidecar=smol_sidecar, mode=mode,
                                    settings=settings, prompt_limit=1)[0]
        assert mine.pi2_matmuls == 30 * 3 * 4, (settings, mode)  # one prompt token + 3 decode steps, 30 layers


def test_relu_family_model_is_held_without_a_sidecar(relu_model: tuple[Path, Path, list]) -> None:
    """A model that states a ReLU-family activation is held in every mode, even without a sidecar: ggml-cpu
    would run the SwiGLU an unpatched llama.cpp's graph holds."""
    model, _, _ = relu_model
    mine = greedy_in_subprocess(model, PROMPTS[:1], 4, pi2=True, settings=AUTO, prompt_limit=1)[0]
    assert mine.pi2_matmuls > 0


def test_layers_left_and_mode_switches(smollm2: Path, smol_sidecar: Path) -> None:
    llm = pi2_gguf.Llama(str(smollm2), sidecar=smol_sidecar, mode="predicted", n_ctx=128, n_threads=2, verbose=False,
                         settings=AUTO)
    try:
        assert llm.layers_left() == list(range(30))
        llm.set_mode("dense")       # left layers are dense already
        llm.set_mode("predicted")   # the load's mode
        with pytest.raises(PluginError, match=r"left FFN layers 0-29 to ggml-cpu.*'layers': 'all'"):
            llm.set_mode("oracle")
    finally:
        llm.close()
    held = pi2_gguf.Llama(str(smollm2), sidecar=smol_sidecar, mode="predicted", n_ctx=128, n_threads=2, verbose=False)
    try:
        assert held.layers_left() == []  # the suite's PI2_LAYERS=all
        held.set_mode("oracle")
    finally:
        held.close()


def test_mixed_placement_follows_the_cost_rule(smollm2: Path, smol_profile, tmp_path: Path) -> None:
    """A fixed |act(gate)| threshold leaves layers at different densities: the load holds exactly the layers
    whose estimated cost (the one `inspect` prints) is below 1, PI2 computes those and ggml-cpu the rest."""
    from pi2_gguf.converter.convert import convert
    from pi2_gguf.runtime import native

    prof = smol_profile.save(tmp_path / "smol.npz")
    sidecar = convert(smollm2, tmp_path / "t.pi2.gguf", threshold=0.4, profile=prof, ranks=[64], progress=False,
                      perplexity_budget=None).path
    cost = native.sparse_cost_c(sidecar)
    expect_left = [il for il, c in enumerate(cost) if c >= 1.0]
    assert 0 < len(expect_left) < 30, cost  # both kinds, or the test shows nothing
    llm = pi2_gguf.Llama(str(smollm2), sidecar=sidecar, n_ctx=128, n_threads=2, verbose=False, settings=AUTO)
    try:
        assert llm.layers_left() == expect_left
        pi2_gguf.reset_counters()
        llm.eval(llm.tokenize(b"The capital of France is")[:1])
        c = pi2_gguf.read_counters()
        computed = [il for il in range(c.n_layers) if c.matmul_calls[il].sum() > 0]
        assert computed == [il for il in range(30) if il not in expect_left]
    finally:
        llm.close()
