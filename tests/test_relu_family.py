"""The ReLU family beyond ReGLU: dReLU (relu(gate) * relu(up), TurboSparse/Bamboo) and FATReLU ((gate > t ?
gate : 0) * up, ProSparse). Synthetic models made by our tools state their activation in GGUF metadata.
The plugin computes it on llama.cpp built with patches/ and on llama.cpp built without (whose graph holds
SwiGLU for every llama FFN), exactly as the patched llama.cpp computes it alone; sparse decode in RAM and on
flash, with predictors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import pi2_gguf
from pi2_gguf.converter import synthetic
from pi2_gguf.converter.convert import convert
from pi2_gguf.errors import SidecarError
from pi2_gguf.gguf_file import read_model_file
from pi2_gguf.llama_build import ensure_stock_site
from pi2_gguf.runtime.isolated import greedy_in_subprocess
from pi2_gguf.sidecar.reader import read as read_sidecar

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from decode_steps import decode  # noqa: E402
from gguf_copy import copy_gguf  # noqa: E402
from settings import RELU_SHAPE  # noqa: E402

PROMPT = "The history of the Roman Empire"
N_TOKENS = 48
THRESHOLD = 0.05  # FATReLU's t for the synthetic model (a visible share of gates in (0, t])


@pytest.fixture(scope="module", params=["drelu", "fatrelu"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(activation, model, sidecar) of a small synthetic model with a gate density of 0.2."""
    act = request.param
    d = tmp_path_factory.mktemp(act)
    model = d / f"{act}.gguf"
    synthetic.make(model, RELU_SHAPE, synthetic.Sparsity(density=0.2), act, QT.F32, calib_tokens=512,
                   heldout_tokens=256, progress=False, threshold=THRESHOLD)
    sidecar = convert(model, d / f"{act}.pi2.gguf", train_tokens=2048, heldout_tokens=512, progress=False,
                      perplexity_budget=None).path
    return act, model, sidecar


@pytest.fixture(scope="module")
def stock_site() -> Path:
    return ensure_stock_site(log=lambda _: None)


def test_model_and_sidecar_state_the_activation(family_model: tuple[str, Path, Path]) -> None:
    act, model, sidecar = family_model
    kv = read_sidecar(sidecar).kv
    assert kv["pi2.activation"] == act and kv["pi2.sparsity.method"] == "relu"
    assert kv["pi2.activation_threshold"] == pytest.approx(THRESHOLD if act == "fatrelu" else 0.0)
    summary = read_model_file(model)[1]
    assert summary.activation == (4 if act == "drelu" else 5)
    assert summary.activation_threshold == pytest.approx(THRESHOLD if act == "fatrelu" else 0.0)


def test_plugin_on_patched_and_unpatched_llama_equals_patched_llama(family_model: tuple[str, Path, Path],
                                                                    stock_site: Path) -> None:
    """The patched llama.cpp alone is the reference (its CPU kernels compute the stated activation). With
    the plugin, the same output on that build and on the unpatched one, whose graph holds SwiGLU: without
    the plugin that build computes something else, which shows the comparison can fail."""
    _, model, sidecar = family_model
    ref = greedy_in_subprocess(model, [PROMPT], 32, pi2=False)[0]
    patched = greedy_in_subprocess(model, [PROMPT], 32, pi2=True, sidecar=sidecar, mode="dense")[0]
    unpatched = greedy_in_subprocess(model, [PROMPT], 32, pi2=True, sidecar=sidecar, mode="dense", llama_site=stock_site)[0]
    unpatched_oracle = greedy_in_subprocess(model, [PROMPT], 32, pi2=True, sidecar=sidecar, mode="oracle",
                                            llama_site=stock_site)[0]
    silu = greedy_in_subprocess(model, [PROMPT], 32, pi2=False, llama_site=stock_site)[0]
    scale = np.abs(ref.logits_first).max()
    for run in (patched, unpatched, unpatched_oracle):
        assert run.pi2_matmuls > 0
        assert run.tokens == ref.tokens
        assert np.abs(np.array(run.logits_first) - ref.logits_first).max() <= 1e-3 * scale
    assert np.abs(np.array(silu.logits_first) - ref.logits_first).max() > 1e-2 * scale


def test_plugin_without_sidecar_on_unpatched_llama(family_model: tuple[str, Path, Path], stock_site: Path) -> None:
    """No sidecar: pi2_gguf.Llama names the model file to the plugin, which reads the stated activation."""
    _, model, _ = family_model
    ref = greedy_in_subprocess(model, [PROMPT], 16, pi2=False)[0]
    run = greedy_in_subprocess(model, [PROMPT], 16, pi2=True, llama_site=stock_site)[0]
    assert run.pi2_matmuls > 0 and run.tokens == ref.tokens
    assert np.abs(np.array(run.logits_first) - ref.logits_first).max() <= 1e-3 * np.abs(ref.logits_first).max()


def _with_biases_and_scales(src: Path, dst: Path) -> Path:
    """src with non-zero biases and per-tensor scales (blk.N.ffn_*.bias, blk.N.ffn_*.scale, which llama.cpp
    applies to a dense FFN after each product and its bias) on gate, up and down."""
    rng = np.random.default_rng(7)
    scales = {"ffn_gate": 0.8, "ffn_up": 1.25, "ffn_down": 0.9}

    def extra(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        kind = name.split(".")[-2]
        if kind not in scales or not name.endswith(".weight"):
            return []
        base = name[: -len(".weight")]
        bias = (0.05 * rng.standard_normal(data.shape[0])).astype(np.float32)
        return [(base + ".bias", bias), (base + ".scale", np.array([scales[kind]], np.float32))]

    return copy_gguf(src, dst, extra)


def test_biases_and_scales_of_a_stated_activation(family_model: tuple[str, Path, Path], stock_site: Path,
                                                  tmp_path: Path) -> None:
    """An FFN with biases and scale tensors between its products and the GLU: the patched llama.cpp alone
    applies both and the stated activation (the reference). With the plugin, the unpatched build, whose graph
    spells SwiGLU on the biased, scaled products, computes the stated activation of those same inputs and so
    the reference; ggml-cpu alone on that build computes SwiGLU, which shows the comparison can fail."""
    _, model, _ = family_model
    odd = _with_biases_and_scales(model, tmp_path / "biased.gguf")
    ref = greedy_in_subprocess(odd, [PROMPT], 16, pi2=False)[0]
    plain = greedy_in_subprocess(model, [PROMPT], 16, pi2=False)[0]
    unpatched = greedy_in_subprocess(odd, [PROMPT], 16, pi2=True, llama_site=stock_site)[0]
    patched = greedy_in_subprocess(odd, [PROMPT], 16, pi2=True)[0]
    silu = greedy_in_subprocess(odd, [PROMPT], 16, pi2=False, llama_site=stock_site)[0]
    scale = np.abs(ref.logits_first).max()
    # the biases and scales change the function, so a build that dropped them would not pass below
    assert np.abs(np.array(plain.logits_first) - ref.logits_first).max() > 1e-2 * scale
    for run in (unpatched, patched):
        assert run.pi2_matmuls > 0 and run.tokens == ref.tokens
        assert np.abs(np.array(run.logits_first) - ref.logits_first).max() <= 1e-3 * scale
    assert np.abs(np.array(silu.logits_first) - ref.logits_first).max() > 1e-2 * scale


def test_oracle_equals_dense_and_predicted_agrees(family_model: tuple[str, Path, Path]) -> None:
    act, model, sidecar = family_model
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="dense", n_ctx=256, n_threads=2, verbose=False)
    try:
        dense_toks, dense_logits = decode(llm, PROMPT, N_TOKENS)
        llm.set_mode("oracle")
        oracle_toks, oracle_logits = decode(llm, PROMPT, N_TOKENS)
        assert oracle_toks == dense_toks
        assert np.abs(oracle_logits - dense_logits).max() <= 1e-4 * np.abs(dense_logits).max()
        pi2_gguf.reset_counters()  # single-token decodes only (a prompt batch may run dense)
        for t in dense_toks[:16]:
            llm.eval([t])
        c = pi2_gguf.read_counters()
        assert c.sparse_tokens.sum() == 16 * c.neurons.shape[0]
        fired = c.rows[:, 1].sum() / c.neurons.sum()  # gates that fired: their up rows were computed
        active = c.active.sum() / c.neurons.sum()
        assert 0.1 < fired < 0.35, fired
        if act == "drelu":  # of the fired gates, only those whose up is positive are active: about half
            assert 0.3 * fired < active < 0.7 * fired, (active, fired)
        else:
            assert active == fired
        llm.set_mode("predicted")
        llm.set_check_recall(True)
        pi2_gguf.reset_counters()
        pred_toks, _ = decode(llm, PROMPT, N_TOKENS, forced=dense_toks)
        c = pi2_gguf.read_counters()
        assert sum(a == b for a, b in zip(pred_toks, dense_toks)) >= 0.99 * N_TOKENS
        assert (c.predicted < 0.6 * c.neurons).all()
    finally:
        llm.close()


def test_flash_decode_equals_in_ram(family_model: tuple[str, Path, Path]) -> None:
    _, model, sidecar = family_model
    # prompts token by token (on flash too) and down by columns in RAM too: one engine, so bit for bit
    same_engine = {"sparse_batch": 64, "down_sparse_max": 1.0}
    ram = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", n_ctx=256, n_threads=2, verbose=False,
                         settings=same_engine)
    want, want_logits = decode(ram, PROMPT, 16)
    ram.close()
    flash = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", n_ctx=256, n_threads=2, verbose=False,
                           memory_budget="2GiB", settings={"cache_max": "1MiB", "sparse_batch": 64})
    pi2_gguf.reset_counters()
    got, got_logits = decode(flash, PROMPT, 16)
    c = pi2_gguf.read_counters()
    flash.close()
    assert got == want and np.array_equal(got_logits, want_logits)
    assert int(c.misses.sum()) > 0


def test_a_sidecar_of_another_activation_is_refused(family_model: tuple[str, Path, Path], tmp_path: Path) -> None:
    act, model, sidecar = family_model
    other = tmp_path / "other.gguf"
    if act == "fatrelu":  # the same weights stating another threshold
        copy_gguf(model, other, set_kv={"llama.ffn_activation_threshold": np.float32(THRESHOLD * 2)})
    else:
        copy_gguf(model, other, set_kv={"llama.ffn_activation": "relu"})
    with pytest.raises(SidecarError, match="was made for FFN activation"):
        pi2_gguf.Llama(str(other), sidecar=sidecar, mode="oracle", n_ctx=64, verbose=False)


def test_an_unknown_stated_activation_is_refused(family_model: tuple[str, Path, Path], tmp_path: Path) -> None:
    _, model, _ = family_model
    bad = tmp_path / "bad.gguf"
    copy_gguf(model, bad, set_kv={"llama.ffn_activation": "swish2"})
    with pytest.raises(pi2_gguf.Pi2Error, match="swish2"):
        pi2_gguf.Llama(str(bad), n_ctx=64, verbose=False)
