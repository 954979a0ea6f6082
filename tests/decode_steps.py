"""Greedy decoding step by step through pi2_gguf.Llama, shared by the sparse-decode tests."""

from __future__ import annotations

import numpy as np

import pi2_gguf
from pi2_gguf.runtime.generate import last_logits


def decode(llm: pi2_gguf.Llama, prompt: str, n: int, forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits before each; with forced, feeds those tokens instead (teacher forcing)."""
    llm.reset()
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
    toks, logits = [], []
    for i in range(n):
        row = last_logits(llm).copy()
        logits.append(row)
        toks.append(int(np.argmax(row)))
        llm.eval([forced[i] if forced is not None else toks[-1]])
    return toks, np.stack(logits)
