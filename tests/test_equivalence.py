"""The plugin computes the FFN densely with ggml-cpu's dot products.

- Decode steps (one token) take ggml-cpu's vec_dot path in stock llama.cpp too: with CPU weight
  repacking off in both, every logit of 32 greedy steps is bit-identical.
- Against stock defaults (repacked Q4_0/Q4_K weights, tinyBLAS for prompt batches) the arithmetic
  differs in accumulation order only. Stock itself differs that much between its two CPU paths
  (repack on/off), so that is the yardstick: after the prompt, pi2's distance to stock (max logit
  difference, KL divergence) stays within twice stock's own. Greedy tokens are the same; they may
  only part at a near-tie, where stock's own top-2 margin is under twice that logit noise.
- Every FFN matmul of every layer ran in PI2, for the prompt batch and each decode step.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np

import pi2_gguf
from pi2_gguf.runtime.generate import greedy
from pi2_gguf.runtime.isolated import greedy_in_subprocess

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which plants",
]
N_TOKENS = 32


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def _kl(p_logits: list[float], q_logits: list[float]) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    lp, lq = log_softmax(np.array(p_logits)), log_softmax(np.array(q_logits))
    return float((np.exp(lp) * (lp - lq)).sum())


def _check_model(path: Path) -> None:
    # bit-exact single-token steps
    exact_stock = greedy_in_subprocess(path, PROMPTS[:1], N_TOKENS, pi2=False, repack=False, prompt_limit=1)[0]
    exact_pi2 = greedy_in_subprocess(path, PROMPTS[:1], N_TOKENS, pi2=True, repack=False, prompt_limit=1)[0]
    assert np.array_equal(np.array(exact_pi2.logits_first), np.array(exact_stock.logits_first))
    assert exact_pi2.tokens == exact_stock.tokens

    stock = greedy_in_subprocess(path, PROMPTS, N_TOKENS, pi2=False)
    stock_norepack = greedy_in_subprocess(path, PROMPTS, 1, pi2=False, repack=False)
    # PI2's own dense kernel for the prompt batch too (a model without a sidecar: this sets the default)
    llm = pi2_gguf.Llama(str(path), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False,
                         settings={"prompt": "pi2"})
    n_layer = llama_cpp.llama_model_n_layer(llm.model)
    for prompt, ref, alt in zip(PROMPTS, stock, stock_norepack):
        pi2_gguf.reset_counters()
        got = greedy(llm, prompt, N_TOKENS, stop_at_eog=False, keep_logits=True)

        noise = float(np.max(np.abs(np.array(ref.logits_first) - np.array(alt.logits_first))))
        noise_kl = _kl(ref.logits_first, alt.logits_first)
        assert np.max(np.abs(np.array(got.logits_first) - np.array(ref.logits_first))) <= 2 * noise + 1e-3, prompt
        assert _kl(got.logits_first, ref.logits_first) <= 2 * noise_kl + 1e-4, prompt
        i = _first_divergence(got.tokens, ref.tokens)
        if i is not None:
            at = greedy_in_subprocess(path, [prompt], 1, pi2=False, keep_prefix=got.tokens[:i])[0]
            top = sorted(at.logits_first, reverse=True)
            assert top[0] - top[1] < 2 * noise, (
                f"{path.name}: {prompt!r} parted from stock at token {i} where stock's top-2 margin is "
                f"{top[0] - top[1]:.3f}, not a near-tie")

        c = pi2_gguf.read_counters()
        evals = 1 + (N_TOKENS - 1)  # the prompt batch + one per decoded token but the last
        tokens = got.prompt_tokens + N_TOKENS - 1
        assert c.n_layers == n_layer
        assert (c.matmul_calls == evals).all(), c.matmul_calls
        assert int(c.matmul_calls.sum()) == n_layer * 3 * evals
        # llama.cpp prunes the last layer to the tokens whose logits it returns: one per evaluation
        assert (c.matmul_tokens[:-1] == tokens).all(), c.matmul_tokens
        assert (c.matmul_tokens[-1] == evals).all(), c.matmul_tokens
        assert (c.glu_calls == evals).all()
        assert (c.glu_tokens[:-1] == tokens).all() and c.glu_tokens[-1] == evals
    # the default: prompt batches run in ggml-cpu on the weights in PI2's buffer, decode steps in PI2
    llm.configure(prompt="cpu")
    pi2_gguf.reset_counters()
    got = greedy(llm, PROMPTS[0], 8, stop_at_eog=False, keep_logits=True)
    c = pi2_gguf.read_counters()
    assert (c.matmul_tokens[:-1] == 8 - 1).all(), c.matmul_tokens  # decode steps only
    assert np.array_equal(np.array(got.logits_first), np.array(stock_norepack[0].logits_first))
    llm.close()


def test_smollm2_matches_stock(smollm2: Path) -> None:
    _check_model(smollm2)


def test_gemma3_matches_stock(gemma3: Path) -> None:
    _check_model(gemma3)
