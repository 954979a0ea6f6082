"""`pi2-gguf perplexity`: llama-perplexity's method, the plugin's dense path equal to stock."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pi2_gguf import corpus
from pi2_gguf.errors import Pi2Error
from pi2_gguf.perplexity import _log_softmax_at, perplexity


@pytest.fixture(scope="module")
def heldout_text() -> str:
    return "\n\n".join(corpus.wiki().split()[1][:60])


def test_log_softmax_matches_direct_formula() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 4
    tgt = np.array([0, 3, 10, 5, 5])
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(axis=1, keepdims=True)
    assert np.allclose(_log_softmax_at(logits, tgt), np.log(p[np.arange(5), tgt]), atol=1e-12)


def test_plugin_dense_perplexity_equals_stock(smollm2: Path, heldout_text: str) -> None:
    stock = perplexity(smollm2, heldout_text, n_ctx=256, max_chunks=4, plugin=False, progress=False)
    pi2 = perplexity(smollm2, heldout_text, n_ctx=256, max_chunks=4, plugin=True, progress=False)
    assert stock.chunks == pi2.chunks == 4 and stock.scored_tokens == 4 * 127
    assert 3.0 < stock.ppl < 100.0  # a 135M model on Wikipedia prose
    assert math.isclose(pi2.ppl, stock.ppl, rel_tol=0.01), (pi2.ppl, stock.ppl)
    assert 0 < stock.err < stock.ppl / 5
    assert stock.running[-1] == pytest.approx(stock.ppl)


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
