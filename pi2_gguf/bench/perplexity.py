"""`pi2-gguf perplexity`: perplexity computed the way llama.cpp's llama-perplexity computes it, so users
can check the quality of a sparse configuration themselves.

As llama-perplexity: the text is tokenized once (BOS first if the model wants one) and cut into
chunks of n_ctx tokens; each chunk is evaluated from an empty cache with its first token replaced by
BOS, and only the second half of each chunk is scored (the first half is context). The running
estimate is printed per chunk as [i]ppl, then "Final estimate: PPL = x +/- err".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import Pi2Error


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    err: float
    chunks: int
    scored_tokens: int
    running: tuple[float, ...]


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row as llama-perplexity's log_softmax computes it: exp in float32, the sum in float64."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))
    return x[np.arange(len(targets)), targets].astype(np.float64) - lse


SPARSE_UBATCH = 4  # the plugin's default sparse batch limit (PI2_SPARSE_BATCH)


def perplexity(model_path: str | Path, text: str, n_ctx: int = 512, max_chunks: int | None = None,
               plugin: bool = True, threads: int | None = None, progress: bool = True,
               sidecar: str | Path | None = None, mode: str = "dense",
               settings: Mapping[str, str | int | float | bool] | None = None,
               memory_budget: int | None = None, chunk_batches: bool = False, repack: bool = True) -> Perplexity:
    """mode oracle/predicted (with the model's sidecar) scores every token through sparse decode: llama's
    micro-batches are cut to the plugin's sparse batch size, so the numbers are what generation sees.
    settings: PI2_* settings for the model (pi2_gguf.Llama's settings=). memory_budget: the FFN on flash behind
    a neuron cache, as decode under that budget computes it (and what only a budget does: PI2_OUTPUT_ROWS).
    chunk_batches: in predicted mode under a budget, each chunk as one batch whose tokens each compute only their own
    predicted neurons (PI2_BATCH_NEURONS=token): decode's neurons, with llama.cpp's batch numerics as the dense score
    has them, ~1.3x faster; its compute buffers grow with the chunk (convert scores so, under a roomy budget).
    repack: llama.cpp's CPU weight repacking (its default), a copy of the weights in RAM; off, the model file stays
    mapped (a model larger than RAM)."""
    from ..runtime.runner import LlamaRunner

    if n_ctx < 16:
        raise Pi2Error(f"--ctx must be at least 16, got {n_ctx}")
    if (mode != "dense" or sidecar is not None or settings) and not plugin:
        raise Pi2Error("a sidecar, settings and the sparse modes need the plugin")
    if plugin:
        from ..runtime.plugin import register

        register()
    ubatch = SPARSE_UBATCH if mode != "dense" else None
    if chunk_batches and mode == "predicted" and memory_budget is not None:
        # on flash a batch computes each token's own predicted neurons with PI2_BATCH_NEURONS=token, the neurons
        # decode computes token by token, so a chunk goes in one batch: its bundles are read and dotted once for all
        # its tokens (docs/MEASUREMENTS.md, "Convert's perplexity scores as one batch a chunk")
        ubatch = n_ctx
        settings = {"batch_neurons": "token", **(settings or {})}
    with LlamaRunner(model_path, n_ctx=n_ctx, n_threads=threads, all_logits=True, sidecar=sidecar, mode=mode,
                     n_ubatch=ubatch, settings=settings, memory_budget=memory_budget, repack=repack) as r:
        tokens = ([r.bos] if r.add_bos else []) + r.tokenize(text)
        n_chunk = len(tokens) // n_ctx
        if max_chunks is not None:
            n_chunk = min(n_chunk, max_chunks)
        if n_chunk < 1:
            raise Pi2Error(f"the text has {len(tokens)} tokens; perplexity needs at least one chunk of {n_ctx}")
        first = n_ctx // 2
        nll = nll2 = 0.0
        count = 0
        running: list[float] = []
        for i in tqdm(range(n_chunk), desc="perplexity", unit="chunk", disable=not progress):
            chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
            window = [r.bos] + chunk[1:] if r.add_bos else chunk
            logits = r.decode(window, outputs_from=first)  # the scored half's logits only
            assert logits is not None
            lp = _log_softmax_at(logits[:n_ctx - 1 - first], np.asarray(chunk[first + 1:n_ctx]))
            nll -= float(lp.sum())
            nll2 += float((lp * lp).sum())
            count += len(lp)
            running.append(math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return Perplexity(ppl, err, n_chunk, count, tuple(running))
