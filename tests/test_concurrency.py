"""Several models in one process, used from several threads at once. The rule (docs/BACKEND.md, "Threads"): each
pi2_gguf.Llama may run in its own thread at the same time as the others, and gives the tokens it gives alone;
a model's settings are its own. One Llama used from two threads at once is not supported (as with
llama_cpp.Llama, whose context is not thread-safe)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import pi2_gguf
from pi2_gguf.runtime.generate import greedy

N_TOKENS = 48
PROMPTS = ("The history of the Roman Empire", "Photosynthesis is the process by which")


def _load(model: Path, sidecar: Path | None, budget: str | None, **kw: object) -> pi2_gguf.Llama:
    return pi2_gguf.Llama(str(model), sidecar=sidecar if sidecar is not None else False, memory_budget=budget,
                          n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False, **kw)


def _generate(llm: pi2_gguf.Llama, prompt: str) -> list[int]:
    return greedy(llm, prompt, N_TOKENS, stop_at_eog=False).tokens


def _alone_then_together(llms: list[pi2_gguf.Llama], prompts: list[str]) -> tuple[list, list]:
    alone = [_generate(llm, p) for llm, p in zip(llms, prompts)]
    together: list[list[int] | BaseException | None] = [None] * len(llms)
    start = threading.Barrier(len(llms))

    def work(k: int) -> None:
        try:
            start.wait()
            for _ in range(2):  # twice, so that the generations overlap whatever thread starts first
                together[k] = _generate(llms[k], prompts[k])
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            together[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(llms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for r in together:
        if isinstance(r, BaseException):
            raise r
    return alone, together


@pytest.mark.parametrize("budget", [None, "1GB"], ids=["ram", "flash"])
def test_two_models_two_threads_same_tokens_as_one_after_the_other(
        smollm2: Path, smol_sidecar: Path, relu_model: tuple[Path, Path, list], budget: str | None) -> None:
    relu, relu_sidecar, _ = relu_model
    a = _load(smollm2, smol_sidecar, budget)
    b = _load(relu, relu_sidecar, budget, settings={"cache_max": 6 << 20} if budget else None)
    alone, together = _alone_then_together([a, b], list(PROMPTS))
    a.close()
    b.close()
    assert together == alone


def test_one_model_twice_in_two_threads_with_own_settings(smollm2: Path, smol_sidecar: Path) -> None:
    """Two Llamas of the same model and sidecar, one predicted and one dense, with different per-model
    settings: each keeps its own mode and settings while both run."""
    a = _load(smollm2, smol_sidecar, None, mode="predicted", settings={"down_sparse_max": 1.0})
    b = _load(smollm2, smol_sidecar, None, mode="dense")
    dense_alone = _load(smollm2, None, None)
    want_dense = _generate(dense_alone, PROMPTS[1])
    dense_alone.close()
    alone, together = _alone_then_together([a, b], [PROMPTS[0], PROMPTS[1]])
    a.close()
    b.close()
    assert together == alone
    assert alone[1] == want_dense  # b stayed dense while a ran predicted with its own down_sparse_max
