"""llama.cpp's own converter on tiny random checkpoints of 17 model families (tests/tiny_families.py): each GGUF
states the family's architecture and holds, layer by layer, the FFN tensors of the family's layout (dense,
routed experts, shared experts, fused gate/up, biases), and stock llama.cpp loads it and greedy-decodes text
that is not one token repeated."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

for _module in ("torch", "transformers", "sentencepiece", "safetensors"):  # the `import` extra
    pytest.importorskip(_module)

from pi2_gguf.llama_build import ensure_stock_site  # noqa: E402
from pi2_gguf.runtime.isolated import greedy_in_subprocess  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
import tiny_families as tf  # noqa: E402

PROMPT = "The history of the Roman Empire covers"
N_TOKENS = 8


@pytest.fixture(scope="module")
def built(tiny_family_ggufs: dict[tuple[str, str], Path]) -> dict[str, Path]:
    """Every family's GGUF in f32 (conftest.py converts them once for the session)."""
    return {name: tiny_family_ggufs[(name, "f32")] for name in tf.FAMILIES}


@pytest.fixture(scope="module")
def stock_site() -> Path:
    return ensure_stock_site(log=lambda _: None)


def _ffn_tensors(tensors: set[str], layer: int) -> set[str]:
    prefix = f"blk.{layer}."
    return {t[len(prefix):] for t in tensors
            if t.startswith(prefix) and ("ffn_" in t or "exp_probs_b" in t) and "_norm" not in t}


@pytest.mark.parametrize("name", list(tf.FAMILIES))
def test_gguf_layout(built: dict[str, Path], name: str) -> None:
    fam = tf.FAMILIES[name]
    arch, kv, tensors = tf.gguf_summary(built[name])
    assert arch == fam.arch
    assert kv[f"{arch}.block_count"] == fam.n_layer
    for layer in range(fam.n_layer):
        assert _ffn_tensors(tensors, layer) == fam.ffn_tensors(layer), f"layer {layer}"
    if fam.moe:
        assert kv[f"{arch}.expert_count"] == 8
        assert kv[f"{arch}.expert_used_count"] == 2
    if fam.dense_lead:
        assert kv[f"{arch}.leading_dense_block_count"] == fam.dense_lead
    # llama.cpp's converter states no activation (SmallThinker's ReGLU is in its graph, not in the file)
    assert f"{arch}.ffn_activation" not in kv


def test_smallthinker_as_the_converter_writes_it(built: dict[str, Path]) -> None:
    """The official layout's sigmoid routing (no moe_primary_router_apply_softmax in its config.json) and its
    experts' size as both feed_forward_length keys."""
    _, kv, _ = tf.gguf_summary(built["smallthinker"])
    assert kv["smallthinker.expert_gating_func"] == 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    assert kv["smallthinker.expert_feed_forward_length"] == kv["smallthinker.feed_forward_length"] == 64


@pytest.mark.parametrize("name", list(tf.FAMILIES))
def test_stock_llama_decodes(built: dict[str, Path], stock_site: Path, name: str) -> None:
    g = greedy_in_subprocess(built[name], [PROMPT], N_TOKENS, pi2=False, ctx=64, llama_site=stock_site)[0]
    assert len(g.tokens) == N_TOKENS
    logits = np.array(g.logits_first)
    assert np.isfinite(logits).all()
    assert logits.std() > 1.0  # not near-uniform
    assert len(set(g.tokens)) > 1


def test_built_files_are_reused(built: dict[str, Path]) -> None:
    out_dir = built["qwen3"].parent
    before = built["qwen3"].stat().st_mtime_ns
    assert tf.build("qwen3", out_dir) == built["qwen3"]
    assert built["qwen3"].stat().st_mtime_ns == before
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no temporary left
