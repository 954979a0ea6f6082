"""Teacher-forced decode (the benchmarks' --decode text): each step evaluates the given text's next token instead of
the token picked, and still reports the token the model picked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np

from pi2_gguf.bench import PROMPT, heldout_text
from pi2_gguf.runtime.generate import greedy, last_logits


def test_forced_steps_evaluate_the_text(smollm2: Path) -> None:
    llm = llama_cpp.Llama(str(smollm2), n_ctx=512, n_threads=2, verbose=False)
    forced = llm.tokenize(b" The river flows north through three valleys before it reaches the sea.", add_bos=False)
    g = greedy(llm, PROMPT, 6, forced=forced)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
    # pick i comes after the prompt and forced[:i]: the same as evaluating that sequence afresh
    for i in range(6):
        llm.reset()
        llm.eval(prompt + forced[:i])
        assert g.tokens[i] == int(last_logits(llm).argmax()), i
    free = greedy(llm, PROMPT, 6, stop_at_eog=False)
    assert free.tokens[0] == g.tokens[0] and free.tokens != g.tokens  # the text, not the picks, was evaluated


def test_heldout_text_covers_the_decode(smollm2: Path) -> None:
    llm = llama_cpp.Llama(str(smollm2), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    for n in (16, 128):
        assert len(llm.tokenize(heldout_text(n).encode(), add_bos=False)) >= n


def test_forced_text_shorter_than_the_decode_is_refused(smollm2: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pi2_gguf.runtime.isolated", "--model", str(smollm2), "-n", "8",
                          "--prompt", "Hello", "--forced-text", "Hi"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--forced-text has" in res.stderr and "7 decode steps" in res.stderr
