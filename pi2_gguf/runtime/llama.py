"""pi2_gguf.Llama: llama_cpp.Llama with the PI2 backend registered first and the model's sidecar bound."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp

from ..errors import MemoryBudgetError, Pi2Error, SidecarError
from ..gguf_file import load_failure, read_model_file
from ..sidecar.format import sidecar_path_for
from . import memory_budget as budgets
from . import plugin
from .counters import CacheInfo, cache_info
from .native import ModelSummary, model_summary_c, sidecar_summary_c, validate_sidecar_c

SidecarArg = str | os.PathLike[str] | bool | None
Settings = Mapping[str, str | int | float | bool]


def resolve_sidecar(model: Path, sidecar: SidecarArg) -> Path | None:
    """The sidecar a model loads with: an explicit path; False for none; None for PI2_SIDECAR if set,
    else MODEL.pi2.gguf beside the model if it exists."""
    if sidecar is False:
        return None
    if sidecar is None or sidecar is True:
        env = os.environ.get("PI2_SIDECAR")
        if env:
            return Path(env)
        default = sidecar_path_for(model)
        if default.is_file():
            return default
        if sidecar is True:
            raise SidecarError(f"sidecar {default}: not found; run `pi2-gguf convert {model}` to make it")
        return None
    return Path(sidecar)


@contextlib.contextmanager
def llama_load_errors(path: Path, n_ctx: int) -> Iterator[None]:
    """llama-cpp-python's ValueErrors for a model llama.cpp cannot load or a context it cannot create, as
    pi2-gguf errors naming the file (llama.cpp's log, silent unless verbose, has the details)."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith("Failed to load model"):
            raise load_failure(path) from None
        if str(e).startswith("Failed to create llama_context"):
            raise Pi2Error(f"llama.cpp could not create a context of {n_ctx} tokens for {path.name} (its KV cache "
                           "does not fit this machine's memory?)") from None
        raise


@contextlib.contextmanager
def vocab_only_model(path: Path) -> Iterator[Any]:
    """llama.cpp's handle of the model's vocabulary alone (no weights, no context), freed on exit: for tokenizing, or
    measuring what a vocabulary holds, before any real load. The loader's warnings are silenced as llama_cpp.Llama
    silences them; a file llama.cpp cannot load is the ModelFileError naming it."""
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with suppress_stdout_stderr(disable=False):
        handle = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        raise load_failure(path)
    try:
        yield handle
    finally:
        llama_cpp.llama_model_free(handle)


def resolve_mode(mode: str | None, sidecar: Path | None) -> str:
    """mode, else PI2_MODE, else predicted with a sidecar and dense without; sparse modes need a sidecar."""
    chosen = mode or os.environ.get("PI2_MODE") or ("predicted" if sidecar is not None else "dense")
    plugin.mode_value(chosen)
    if chosen != "dense" and sidecar is None:
        raise SidecarError(f"mode {chosen} needs a sidecar; run `pi2-gguf convert MODEL.gguf` and pass sidecar=")
    return chosen


def check_sidecar_matches(model: Path, sidecar: Path, summary: ModelSummary | None = None) -> None:
    """Refuses a sidecar made for another model before llama loads anything (the plugin checks again
    on the weights it receives)."""
    _, fp = sidecar_summary_c(sidecar)
    summary = summary or model_summary_c(model)
    if summary.n_layer == 0:
        raise SidecarError(f"sidecar {sidecar}: {model.name} has no gated FFN layers (blk.N.ffn_gate/up/down.weight), "
                           "so no sidecar applies to it")
    if summary.fingerprint != fp:
        raise SidecarError(f"sidecar {sidecar}: was made for another model (its fingerprint 0x{fp:016x} is not "
                           f"{model.name}'s 0x{summary.fingerprint:016x})")


def prepare_sidecar(model: Path, sidecar: SidecarArg, mode: str | None,
                    summary: ModelSummary | None = None) -> tuple[Path | None, str]:
    """(sidecar, mode) a model loads with, the sidecar validated by the plugin's reader and checked
    against the model's weights; raises SidecarError naming the problem."""
    path = resolve_sidecar(model, sidecar)
    chosen = resolve_mode(mode, path)
    if path is not None:
        if path.exists() and not path.is_file():  # a FIFO would block the reader's open
            raise SidecarError(f"sidecar {path}: is not a regular file")
        validate_sidecar_c(path)
        check_sidecar_matches(model, path, summary)
    return path, chosen


def _output_rows(settings: Settings | None) -> int | None:
    """This model's PI2_OUTPUT_ROWS as the budget precheck counts it (0 where it is malformed: the plugin then
    refuses the load with its own message); None where neither the settings nor the environment give one (the
    sidecar's recorded value then holds)."""
    value = (settings or {}).get("output_rows", os.environ.get("PI2_OUTPUT_ROWS") or None)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0



class Llama(llama_cpp.Llama):
    """Drop-in for llama_cpp.Llama: same arguments; the model's FFN runs in the PI2 backend.

    sidecar: the model's pi2 sidecar (default: PI2_SIDECAR, else MODEL.pi2.gguf beside the model if it
    exists; False: none). mode: "predicted" (default with a sidecar), "oracle" or "dense" (default
    without); PI2_MODE overrides the default. The model file is validated first, so a missing, non-GGUF
    or truncated file raises pi2_gguf.ModelFileError naming the problem instead of a loader failure.

    memory_budget ("600MB", "2GiB", bytes; default PI2_MEMORY_BUDGET): the whole process stays within it.
    The FFN then stays on flash: llama loads without mmap and PI2 keeps none of the FFN weights it is
    handed (it checks them against the sidecar); what the budget leaves after llama's weights, KV cache
    and compute buffers becomes the neuron cache. n_batch defaults to 32 then (llama sizes its compute
    buffers by it); PI2 reads each layer's bundles once per batch of a prompt, so where the budget has a few
    MB to spare, n_batch=128 makes long prompts faster (up to 5x on MoE models). Raises MemoryBudgetError stating the minimum if the budget is too small.

    settings: per-model PI2_* settings (docs/SETTINGS.md), e.g. {"down_sparse_max": 1.0, "cache_max": "6MiB"},
    applied to this model's binding before its weights load (see configure())."""

    def __init__(self, model_path: str | Path, *args: Any, sidecar: SidecarArg = None, mode: str | None = None,
                 check_recall: bool = False, memory_budget: str | int | None = None, settings: Settings | None = None,
                 **kwargs: Any) -> None:
        path, summary = read_model_file(model_path)
        plugin.register()
        self.pi2_sidecar, self.pi2_mode = prepare_sidecar(path, sidecar, mode, summary)
        budget_arg = memory_budget if memory_budget is not None else os.environ.get("PI2_MEMORY_BUDGET") or None
        self.pi2_memory_budget = None if budget_arg is None else budgets.parse_size(budget_arg)
        if self.pi2_memory_budget is not None:
            if self.pi2_sidecar is None:
                raise MemoryBudgetError(budgets.no_sidecar(path))
            if kwargs.get("use_mmap", False):
                raise MemoryBudgetError("a memory budget loads the model without mmap; drop use_mmap=True")
            kwargs["use_mmap"] = False
            kwargs.setdefault("n_batch", budgets.N_BATCH)
            budgets.precheck(self.pi2_memory_budget, path, self.pi2_sidecar, _output_rows(settings))
        self._pi2_load(path, args, kwargs, settings)
        if check_recall:
            self.set_check_recall(True)

    def _pi2_load(self, path: Path, args: tuple[Any, ...], kwargs: dict[str, Any], settings: Settings | None) -> None:
        """llama's load with this model's binding, and under a budget the neuron cache sized from what the
        load left; MemoryBudgetError (the model closed) if the budget is too small."""
        self.pi2_binding = 0
        with plugin.model_load(self.pi2_sidecar, self.pi2_mode, flash=self.pi2_memory_budget is not None, model=path,
                               settings=settings) as self.pi2_binding:
            with llama_load_errors(path, kwargs.get("n_ctx", 512)):
                super().__init__(str(path), *args, **kwargs)
        self._pi2_constructed = True
        if self.pi2_memory_budget is not None:
            # what the plugin refused while llama loaded and reserved its graphs (a weight that is not the
            # sidecar's, an FFN graph that cannot run from flash): the model could not decode
            why = plugin.binding_error(self.pi2_binding)
            if why:
                self.close()
                raise SidecarError(why)
            reserved = budgets.compute_reserve(self._ctx.ctx, self._n_vocab, self.context_params.n_ubatch,
                                               self._logits_all or bool(self.context_params.embeddings),
                                               self.scores.nbytes if self._logits_all else 0)
            budgets.drop_page_cache(path)
            gc.collect()  # GGUF readers of the checks above may still map file pages, which count as resident
            try:
                plugin.set_budget(self.pi2_binding, self.pi2_memory_budget, reserved)
            except MemoryBudgetError:
                self.close()
                raise

    def cache_info(self) -> CacheInfo | None:
        """The neuron cache's segments, with a memory budget; None without."""
        return cache_info(self.pi2_binding) if self.pi2_binding else None

    def budget_use(self) -> budgets.BudgetUse | None:
        """Where the memory budget went, item by item (runtime, llama.cpp's weights and KV cache, predictors, compute
        buffers, tables, margin) and what the caches got; None without a budget."""
        info = self.cache_info()
        if info is None or self.pi2_memory_budget is None or not info.budget_bytes:
            return None
        from .llama_memory import llama_memory

        return budgets.budget_use(info, llama_memory(self._ctx.ctx))

    def configure(self, **settings: str | int | float | bool) -> None:
        """Per-model PI2_* settings (docs/SETTINGS.md) for this model, e.g. configure(down_sparse_max=1.0,
        prompt="pi2"). A model without a sidecar has no binding of its own: then this sets the defaults that
        every model without its own value follows. PI2_PREDICTOR and the flash settings act when a model's
        neuron cache is made (pass those as Llama(settings=...)). Raises ConfigError naming a refused value."""
        for name, value in settings.items():
            plugin.configure(name, value, self.pi2_binding)

    def set_mode(self, mode: str) -> None:
        """Switches between dense, oracle and predicted decode without reloading. Layers the load left to
        ggml-cpu (layers_left()) stay there: a sparse mode other than the load's is refused if there are any."""
        if self.pi2_binding == 0:
            resolve_mode(mode, None)  # only dense is possible without a sidecar
            return
        plugin.set_mode(self.pi2_binding, mode)
        self.pi2_mode = mode

    def layers_left(self) -> list[int]:
        """The FFN layers this model's load left to ggml-cpu because PI2 would not run them faster in the
        load's mode (docs/BACKEND.md, "Which layers PI2 holds"); those run stock llama.cpp's kernels in every
        mode. Without a sidecar PI2 holds only the FFN of a model that states a ReLU-family activation:
        then every layer of any other model is left, and this lists none (there is no binding to ask)."""
        return plugin.layers_left(self.pi2_binding) if self.pi2_binding else []

    def set_check_recall(self, on: bool) -> None:
        """In predicted mode, also compute the full gate to count active neurons the predictor missed."""
        if self.pi2_binding:
            plugin.set_check_recall(self.pi2_binding, on)

    def eval(self, tokens: Sequence[int]) -> None:
        try:
            super().eval(tokens)
        except RuntimeError as e:
            why = plugin.binding_error(self.pi2_binding) if self.pi2_binding else ""
            if why:
                raise SidecarError(why) from e
            raise

    def close(self) -> None:
        super().close()
        if getattr(self, "pi2_binding", 0):
            plugin.release_binding(self.pi2_binding)
            self.pi2_binding = 0

    def __del__(self) -> None:
        # a Llama rejected before llama_cpp.Llama.__init__ ran has nothing to close
        if getattr(self, "_pi2_constructed", False):
            super().__del__()  # calls close()
