"""Several models in one process, used from several threads at once. The rule (docs/BACKEND.md, "Threads"): each
pi2_gguf.Llama may run in its own thread at the same time as the others, and gives the tokens it gives alone;
a model's settings are its own. One Llama used from two threads at once is not supported (as with
llama_cpp.Llama, whose context is not thread-safe)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest

import pi2_gguf
from pi2_gguf.runtime.generate import greedy

T = TypeVar("T")
N_TOKENS = 48
PROMPTS = ("The history of the Roman Empire", "Photosynthesis is the process by which")


def _load(model: Path, sidecar: Path | None, budget: str | None, **kw: object) -> pi2_gguf.Llama:
    return pi2_gguf.Llama(str(model), sidecar=sidecar if sidecar is not None else False, memory_budget=budget,
                          n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False, **kw)


def _generate(llm: pi2_gguf.Llama, prompt: str) -> list[int]:
    return greedy(llm, prompt, N_TOKENS, stop_at_eog=False).tokens


def _in_threads(fns: list[Callable[[], T]]) -> list[T]:
    """Runs each fn in its own thread, all released at once by a barrier; their results in order. An
    exception in a thread is re-raised here, in the calling thread."""
    out: list[T | BaseException | None] = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def work(k: int) -> None:
        try:
            start.wait()
            out[k] = fns[k]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            out[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out  # type: ignore[return-value]


def _alone_then_together(llms: list[pi2_gguf.Llama], prompts: list[str]) -> tuple[list, list]:
    alone = [_generate(llm, p) for llm, p in zip(llms, prompts)]

    def twice(k: int) -> list[int]:  # twice, so that the generations overlap whatever thread starts first
        _generate(llms[k], prompts[k])
        return _generate(llms[k], prompts[k])

    together = _in_threads([partial(twice, k) for k in range(len(llms))])
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


def test_models_constructed_in_two_threads_at_once(smollm2: Path, smol_sidecar: Path,
                                                   relu_model: tuple[Path, Path, list]) -> None:
    """Loads wait for each other (the plugin ties the weights allocated during a load to that load's binding),
    so two threads may construct their models at the same moment and get each its own."""
    relu, relu_sidecar, _ = relu_model
    specs = [(smollm2, smol_sidecar), (relu, relu_sidecar)]
    made = _in_threads([partial(_load, *spec, None) for spec in specs])
    got = [_generate(m, p) for m, p in zip(made, PROMPTS)]
    for m in made:
        m.close()
    want = []
    for spec, p in zip(specs, PROMPTS):
        llm = _load(*spec, None)
        want.append(_generate(llm, p))
        llm.close()
    assert got == want


def test_plugin_refuses_a_second_load_while_one_is_in_progress(smol_sidecar: Path, smollm2: Path) -> None:
    """Frontends other than pi2_gguf (which serializes its loads) get a clear refusal, not each other's weights."""
    from pi2_gguf.errors import SidecarError
    from pi2_gguf.runtime import plugin

    plugin.register()
    first = plugin.load_begin(smol_sidecar, "predicted", model=smollm2)
    try:
        for sidecar in (smol_sidecar, None):
            with pytest.raises(SidecarError, match="another model is being loaded with PI2 in this process"):
                plugin.load_begin(sidecar, "predicted" if sidecar else "dense", model=smollm2)
    finally:
        plugin.load_end()
        plugin.release_binding(first)
    second = plugin.load_begin(None, "dense", model=smollm2)  # after load_end, loads are taken again
    plugin.load_end()
    assert second == 0
