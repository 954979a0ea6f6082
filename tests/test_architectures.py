"""PI2 computes the function llama.cpp's graph for a model computes, with or without a sidecar: the activation
comes from the model (its architecture's graph, else its statement), a sidecar only records what it was made for
and is refused when the model means another.

The SmallThinker regression: llama.cpp's converter writes no smallthinker.ffn_activation, and llama.cpp builds
SmallThinker's experts as ReGLU whatever the file says. convert used to default such a model to SiLU and the
plugin took the sidecar's SiLU as the model's, so every held expert was computed with the wrong activation."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pi2_gguf.converter import model_ffn, synthetic, synthetic_moe
from pi2_gguf.errors import Pi2Error
from pi2_gguf.runtime.isolated import greedy_in_subprocess

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from gguf_copy import copy_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire begins with the founding of the city"
N_TOKENS = 12
SMALLTHINKER_SHAPE = synthetic_moe.MoeShape(n_embd=256, n_ff=512, n_layer=3, n_head=4, n_head_kv=2, n_expert=8,
                                            n_expert_used=2, n_ctx=512)


def test_architecture_activation_tables_agree() -> None:
    """The plugin (activation.h) and convert (model_ffn.ARCH_ACTIVATION) name the same architectures whose graph
    builds the FFN activation itself, with the same activation."""
    text = (ROOT / "ggml-backend" / "src" / "graph" / "activation.h").read_text()
    body = text[text.index("pi2_arch_activations[] = {"):]
    body = body[:body.index("};")]
    names = {"PI2_ACT_SILU": "silu", "PI2_ACT_GELU": "gelu", "PI2_ACT_GELU_ERF": "gelu_erf", "PI2_ACT_RELU": "relu",
             "PI2_ACT_DRELU": "drelu", "PI2_ACT_FATRELU": "fatrelu", "PI2_ACT_SWIGLU_OAI": "swiglu_oai"}
    c_table = {arch: names[kind] for arch, kind in re.findall(r'\{\s*"([^"]+)",\s*(PI2_ACT_\w+),', body)}
    assert c_table and c_table == model_ffn.ARCH_ACTIVATION
    assert c_table["smallthinker"] == "relu"


@pytest.fixture(scope="module")
def smallthinker_as_converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A SmallThinker-layout MoE laid out as llama.cpp's converter writes it (no smallthinker.ffn_activation key;
    F32 weights, ReLU-sparse experts), and the sidecar `convert` makes for it with its defaults."""
    from pi2_gguf.converter.convert import convert

    d = tmp_path_factory.mktemp("smallthinker")
    stated = d / "stated.gguf"
    synthetic_moe.make_moe(stated, SMALLTHINKER_SHAPE, synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           "smallthinker", "relu", QT.F32, progress=False, calib_tokens=256)
    model = copy_gguf(stated, d / "st.gguf", drop_kv=["smallthinker.ffn_activation"])
    assert model_ffn.ModelFfn(model).activation == "relu"  # what the graph builds, not a default
    sidecar = convert(model, d / "st.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                      perplexity_budget=None).path
    return model, sidecar


def test_smallthinker_without_activation_key_decodes_as_stock(smallthinker_as_converted: tuple[Path, Path]) -> None:
    """With its sidecar, PI2's greedy tokens equal stock llama.cpp's in dense and oracle mode, in RAM (PI2 holding
    every expert) and under a memory budget (experts read from the sidecar through a small cache)."""
    from pi2_gguf.sidecar.reader import read as read_sidecar

    model, sidecar = smallthinker_as_converted
    assert read_sidecar(sidecar).kv["pi2.activation"] == "relu"
    stock = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    ref = np.array(stock.logits_first)
    flash = {"cache_max": "1MiB", "sparse_batch": 64}
    for mode in ("dense", "oracle"):
        ram = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                   settings={"layers": "all"})[0]
        assert ram.pi2_matmuls > 0 and ram.layers_in_pi2 == "3/3", mode
        assert ram.tokens == stock.tokens, mode
        assert np.abs(np.array(ram.logits_first) - ref).max() <= 1e-3 * np.abs(ref).max(), mode
        budget = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                      memory_budget=2 << 30, settings=flash)[0]
        assert budget.tokens == stock.tokens, mode
        assert budget.io["bundle_bytes"] > 0 and budget.io["misses"] > 0, (mode, budget.io)


def test_sidecar_made_for_another_activation_is_refused(smallthinker_as_converted: tuple[Path, Path],
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sidecar made before convert knew SmallThinker's graph (it recorded SiLU) never replaces the model's ReGLU:
    the load is refused with a message naming both activations, with the model named or only the sidecar
    (PI2_SIDECAR, where the plugin is not told the model)."""
    from pi2_gguf.converter.convert import convert

    model, _ = smallthinker_as_converted
    monkeypatch.setattr(model_ffn, "ARCH_ACTIVATION", {})
    old = convert(model, tmp_path / "old.pi2.gguf", train_tokens=512, heldout_tokens=256, progress=False,
                  perplexity_budget=None, expert_reads="bundles").path
    monkeypatch.undo()
    from pi2_gguf.sidecar.reader import read as read_sidecar
    assert read_sidecar(old).kv["pi2.activation"] == "silu"
    with pytest.raises(RuntimeError, match=r"made for FFN activation silu .* with relu"):
        greedy_in_subprocess(model, [PROMPT], 2, pi2=True, sidecar=old, mode="dense")
    with pytest.raises(Pi2Error, match=r"made for FFN activation silu .* with relu"):
        import pi2_gguf
        pi2_gguf.Llama(str(model), sidecar=old, mode="oracle", n_ctx=128, n_threads=2, verbose=False)
