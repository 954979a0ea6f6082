"""`pi2-gguf perplexity`: llama-perplexity's method, the plugin's dense path equal to stock."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pi2_gguf.assets import corpus
from pi2_gguf.bench.perplexity import _log_softmax_at, perplexity
from pi2_gguf.errors import Pi2Error


@pytest.fixture(scope="module")
def heldout_text() -> str:
    return "\n\n".join(corpus.wiki().split()[1][:60])


def test_log_softmax_matches_direct_formula() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 4
    tgt = np.array([0, 3, 10, 5, 5])
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(axis=1, keepdims=True)
    # exp in float32 as llama-perplexity computes it: within float32's rounding of the exact value
    assert np.allclose(_log_softmax_at(logits, tgt), np.log(p[np.arange(5), tgt]), atol=1e-6)
    assert not np.allclose(_log_softmax_at(logits, tgt), np.log(p[np.arange(5), tgt]) + 1e-4, atol=1e-6)


def test_plugin_dense_perplexity_equals_stock(smollm2: Path, heldout_text: str) -> None:
    stock = perplexity(smollm2, heldout_text, n_ctx=256, max_chunks=4, plugin=False, progress=False)
    pi2 = perplexity(smollm2, heldout_text, n_ctx=256, max_chunks=4, plugin=True, progress=False)
    assert stock.chunks == pi2.chunks == 4 and stock.scored_tokens == 4 * 127
    assert 3.0 < stock.ppl < 100.0  # a 135M model on Wikipedia prose
    assert math.isclose(pi2.ppl, stock.ppl, rel_tol=0.01), (pi2.ppl, stock.ppl)
    assert 0 < stock.err < stock.ppl / 5
    assert stock.running[-1] == pytest.approx(stock.ppl)


def test_a_window_s_outputs_from_a_token_on_are_the_full_window_s(smollm2: Path, heldout_text: str) -> None:
    """A perplexity scores a window's second half, so only those tokens have outputs (llama.cpp then skips the
    first half's rows of the last layer and the output matrix): their logits are the full window's rows."""
    from pi2_gguf.runtime.runner import LlamaRunner

    with LlamaRunner(smollm2, n_ctx=128, all_logits=True) as r:
        toks = r.tokenize(heldout_text)[:128]
        full = r.decode(toks)
        half = r.decode(toks, outputs_from=64)
        assert full is not None and half is not None and half.shape == (64, full.shape[1])
        assert np.allclose(half, full[64:], rtol=1e-4, atol=1e-3), float(np.abs(half - full[64:]).max())
        for bad in (-1, 128):
            with pytest.raises(ValueError, match=f"outputs from token {bad} of 128"):
                r.decode(toks, outputs_from=bad)
    with LlamaRunner(smollm2, n_ctx=128) as r:
        with pytest.raises(ValueError, match="only all_logits runs"):
            r.decode(toks, outputs_from=1)


def test_too_short_text_is_a_clear_error(smollm2: Path) -> None:
    with pytest.raises(Pi2Error, match="at least one chunk of 512"):
        perplexity(smollm2, "Too short.", n_ctx=512, plugin=False, progress=False)


def test_cli_prints_like_llama_perplexity(smollm2: Path, tmp_path: Path, heldout_text: str) -> None:
    text = tmp_path / "t.txt"
    text.write_text(heldout_text)
    res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "perplexity", str(smollm2), "--text", str(text),
                          "--ctx", "128", "--chunks", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("[1]") and "[2]" in res.stdout
    assert "Final estimate: PPL = " in res.stdout and "+/-" in res.stdout
    res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "perplexity", str(smollm2), "--text",
                          str(tmp_path / "missing.txt")], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "text file not found" in res.stderr


def test_sparse_perplexity_at_50_percent(smollm2: Path, smol_sidecar: Path, smol_cats_sidecar: Path,
                                        heldout_text: str) -> None:
    """SmolLM2 at 50% sparsity, every scored token through sparse decode. The default criterion
    (product: the smallest |act(gate) * up| dropped) stays within the issue's +5% of dense (measured
    +3.6% oracle); CATS (the smallest |act(gate)|) at the same density loses far more (+36%)."""
    import pi2_gguf

    kw = dict(n_ctx=256, max_chunks=3, progress=False)
    dense = perplexity(smollm2, heldout_text, mode="dense", sidecar=smol_sidecar, **kw)
    pi2_gguf.reset_counters()
    oracle = perplexity(smollm2, heldout_text, mode="oracle", sidecar=smol_sidecar, **kw)
    c = pi2_gguf.read_counters()
    frac = c.active.sum() / c.neurons.sum()
    assert 0.4 < frac < 0.6, frac  # the sidecar's 50% target holds on this text
    up_frac = c.rows[:, 1].sum() / c.neurons.sum()  # up rows: the neurons |act| admitted, 0.9 at 50%
    assert 0.85 < up_frac < 0.95, up_frac
    # SmolLM2's predictors cost more than they save; measure them anyway
    predicted = perplexity(smollm2, heldout_text, mode="predicted", sidecar=smol_sidecar, settings={"predictor": "always"},
                           **kw)
    cats = perplexity(smollm2, heldout_text, mode="oracle", sidecar=smol_cats_sidecar, **kw)
    assert dense.scored_tokens == oracle.scored_tokens == predicted.scored_tokens == cats.scored_tokens
    assert dense.ppl < oracle.ppl <= dense.ppl * 1.05, (oracle.ppl, dense.ppl)
    # predictors forced on (rank 64, 99% recall of the active neurons): the 1% they miss cost more than
    # CATS's misses did, measured 12.92 against oracle 12.61; near oracle, not within a fixed few percent
    assert abs(math.log(predicted.ppl / oracle.ppl)) < 0.1, (predicted.ppl, oracle.ppl)
    assert oracle.ppl * 1.15 < cats.ppl <= dense.ppl * 1.5, (cats.ppl, oracle.ppl, dense.ppl)


def test_cli_perplexity_mode(smollm2: Path, smol_sidecar: Path, tmp_path: Path, heldout_text: str) -> None:
    text = tmp_path / "t.txt"
    text.write_text(heldout_text)
    res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "perplexity", str(smollm2), "--text", str(text),
                          "--ctx", "128", "--chunks", "1", "--mode", "oracle", "--sidecar", str(smol_sidecar)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "mode oracle" in res.stdout and "active neurons per token" in res.stdout
    res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "perplexity", str(smollm2), "--text", str(text),
                          "--ctx", "128", "--chunks", "1", "--mode", "oracle"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 2 and "needs a sidecar" in res.stderr


def test_budget_scores_a_chunk_as_one_batch_of_each_token_s_neurons(smollm2: Path, smol_sidecar: Path,
                                                                     heldout_text: str) -> None:
    """Under a memory budget predicted mode can score a chunk as one batch whose tokens each compute only their own
    predicted neurons (chunk_batches, PI2_BATCH_NEURONS=token: convert's scores): as many gate rows as decode token
    by token computes, where the batch's union (the prompt default) computes more. Where every neuron is selected
    the two modes are one function.
    The perplexities differ by llama.cpp's own batch numerics (stock SmolLM2 on held-out text: 13.264 in batches
    of 256, 13.308 token by token), amplified by the thresholds a 50% sidecar cuts at, so only their order of
    magnitude is checked."""
    import pi2_gguf

    kw = dict(n_ctx=128, max_chunks=2, progress=False, sidecar=smol_sidecar, mode="predicted",
              memory_budget=2_000_000_000)
    # SmolLM2's predictors do not pay: run them so that selections differ per token; the bundles (this budget would read
    # the layers whole from the model file)
    always = {"predictor": "always", "dense_reads": "bundles"}
    auto = {"predictor": "auto", "dense_reads": "bundles"}
    runs = {}
    one = dict(chunk_batches=True)
    for name, extra in (("decode", dict(settings=always)), ("batch", dict(settings=always, **one)),
                        ("union", dict(settings={**always, "batch_neurons": "union"}, **one)),
                        ("all batch", dict(settings=auto, **one)),
                        ("all union", dict(settings={**auto, "batch_neurons": "union"}, **one))):
        pi2_gguf.reset_counters()
        ppl = perplexity(smollm2, heldout_text, **kw, **extra)  # type: ignore[arg-type]
        c = pi2_gguf.read_counters()
        runs[name] = (ppl.ppl, int(c.rows[:, 0].sum()), int(c.sparse_tokens.sum()))
    (decode, dg, dt), (batch, bg, bt), (union, ug, ut) = runs["decode"], runs["batch"], runs["union"]
    assert dt == bt == ut > 0
    # the same neurons (predictor scores differ only by the order sums are taken in)
    assert abs(bg - dg) <= 5e-3 * dg, (bg, dg)
    assert abs(math.log(batch / decode)) < 0.1, (batch, decode)
    # the union: every token of the chunk computes any token's neurons
    assert ug > 1.005 * bg, (ug, bg, union)
    # no predictor runs (SmolLM2's do not pay): every neuron selected, token and union compute alike
    assert runs["all batch"] == runs["all union"], runs
    assert runs["all batch"][1] >= ug > bg
