"""Greedy decoding with timing, shared by the CLI, the benchmarks and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import llama_cpp
import numpy as np


@dataclass
class Greedy:
    prompt_tokens: int
    tokens: list[int]
    prompt_seconds: float
    decode_seconds: float
    logits_first: list[float] = field(default_factory=list)  # logits after the prompt, for numeric checks
    pi2_matmuls: int = 0  # FFN matmuls PI2 executed (subprocess runs with --pi2)
    layers_in_pi2: str = ""  # "held/all" FFN layers in which PI2 computed anything (subprocess runs with --pi2)
    active_fraction: float = 0.0  # sparse decode: active neurons / all neurons, over sparsely decoded tokens
    # with a memory budget, over the decoded tokens: bundle bytes read, bundles found per cache segment,
    # time the compute threads waited for reads; and what the process read from disk in all (/proc/self/io)
    io: dict = field(default_factory=dict)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """The logits llama.cpp left in the context for the last evaluated token: a view, valid until the next
    eval (Llama.scores is only filled with logits_all=True)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def greedy(llm: llama_cpp.Llama, prompt: str, n: int, stop_at_eog: bool = True, keep_logits: bool = False,
           prefix: list[int] | None = None, prompt_limit: int = 0,
           after_prompt: Callable[[], None] | None = None, forced: list[int] | None = None) -> Greedy:
    """Evaluates the prompt, then samples n tokens greedily. Graph evaluations: one for the prompt
    (when it fits in n_batch) plus n - 1 single-token ones (the last sampled token is not evaluated).
    forced: teacher forcing; step i evaluates forced[i] instead of the token picked (which is still returned),
    so the decode follows that text (no stop at end of generation then)."""
    llm.reset()
    toks = llm.tokenize(prompt.encode(), add_bos=True) + list(prefix or [])
    if prompt_limit > 0:
        toks = toks[:prompt_limit]  # e.g. 1: every evaluation is a single-token (decode) step
    t0 = time.perf_counter()
    llm.eval(toks)
    prompt_seconds = time.perf_counter() - t0
    logits: list[float] = []
    if keep_logits:
        logits = last_logits(llm).astype(float).tolist()
    if after_prompt is not None:
        after_prompt()
    t1 = time.perf_counter()  # decode time starts after the logits copy
    out: list[int] = []
    for i in range(n):
        # greedy = argmax of the logits llama.cpp left in the context (0.03 ms): llama-cpp-python's
        # Llama.sample(top_k=1) picks the same token but costs ~2 ms of Python per call, which would be
        # timed as decode; llama-bench's tg likewise times llama_decode only
        tok = int(last_logits(llm).argmax())
        if stop_at_eog and not forced and llama_cpp.llama_token_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
        if i + 1 < n:
            llm.eval([forced[i] if forced and i < len(forced) else tok])
    t2 = time.perf_counter()
    return Greedy(len(toks), out, prompt_seconds, t2 - t1, logits)
