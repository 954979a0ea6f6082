"""Memory budgets: parsing "600MB", the lower bound a model needs before it loads, the part of llama.cpp's compute
buffers a budget reserves, and the page cache a budgeted load leaves behind.

The budget bounds the whole process. After the model and context exist, the plugin measures this
process's resident memory (llama's non-FFN weights, KV cache, predictors, Python), subtracts it and the
compute buffers reserved here, and makes the rest the neuron cache (pi2_binding_set_budget)."""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import MemoryBudgetError
from . import native
from .llama_memory import LlamaMemory, llama_memory

if TYPE_CHECKING:
    from .counters import CacheInfo

# n_batch (and n_ubatch) under a budget: llama sizes its compute buffers by it, and a prompt batch reads each
# layer's bundles once. 128 against 32 (2026-11-26): SmallThinker-shaped prompts under half the file 5x faster,
# Qwen2.5-1.5B's 6%, decode unchanged, but 5-10 MB less neuron cache, which tight budgets do not have (the
# dReLU 1.5B under 480 MB needs 487 MB at 128); loading again at 32 after a refusal kept 5-25 MB of the first
# load resident. So 32, and 128 is the caller's choice.
N_BATCH = 32


def parse_size(value: str | int | float, what: str = "memory budget") -> int:
    """Bytes from "600MB" / "0.6GB" (powers of 10), "512MiB" (powers of 2), a plain number of bytes, or a
    number: the plugin's parser (native.parse_size), so every size reads alike. MemoryBudgetError naming
    `what` unless the size is positive."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = int(value)
    else:
        try:
            size = native.parse_size(str(value))
        except ValueError as e:
            raise MemoryBudgetError(f"{what} {e}") from e
    if size <= 0:
        raise MemoryBudgetError(f"{what} '{value}' is not a positive size")
    return size


def no_sidecar(path: Path, who: str = "a memory budget") -> str:
    """What `who` (a budget, the planner) without the model's sidecar is refused with: the convert to run, or why
    convert cannot make one for this model's FFN layout (docs/ARCHITECTURES.md)."""
    from ..converter.model_ffn import gguf_layout_refusal

    why = gguf_layout_refusal(path)
    if why is not None:
        return f"{who} needs the model's sidecar, and {path.name} can have none: {why}"
    return f"{who} needs the model's sidecar; run `pi2-gguf convert {path}`"


def precheck(budget: int, path: Path, sidecar: Path, output_rows: int | None = None) -> None:
    """Refuses, before anything loads, a budget below what the model needs at the very least, as the plugin counts
    it (native.budget_floor: this process now, the model's resident non-FFN weights, one layer of bundles and the
    margin; the token embedding stays in the model file, a tied one counts once, and with output_rows > 0
    (PI2_OUTPUT_ROWS; None: the sidecar's recorded value) the output matrix as its smaller copy). The plugin states
    the exact minimum, with the predictors it keeps, KV cache and compute buffers, after the load."""
    gc.collect()  # unmaps what GGUF readers the caller dropped still map: mapped pages count as resident
    f = native.budget_floor(path, sidecar, output_rows)
    if budget < f.need:
        raise MemoryBudgetError(
            f"memory budget {budget / 1e6:.0f} MB is too small for {path.name}: it needs more than {f.need / 1e6:.0f} MB "
            f"(this process {f.resident / 1e6:.0f} MB, resident non-FFN weights {f.non_ffn / 1e6:.0f} MB, neuron cache "
            f"at least {f.one_layer / 1e6:.0f} MB, margin {f.margin / 1e6:.0f} MB; plus predictors, KV cache and "
            "compute buffers)")


def compute_reserve(ctx: int | ctypes.c_void_p, n_vocab: int, n_ubatch: int, all_outputs: bool, scores_bytes: int) -> int:
    """What llama will still touch after the budget is read: the compute buffers of the context `ctx` (a
    llama_context pointer; llama.cpp's own report, llama_memory.py) and, with logits_all, the scores array.
    llama sizes the compute buffer for a batch whose every token has an output, but
    llama-cpp-python asks for the last token's logits only (unless logits_all or embeddings), so the
    other n_ubatch - 1 rows of the logits tensor are never touched (Qwen2.5-1.5B at n_batch 32: 18.5 of
    the 22 MiB; after a prompt and 16 tokens the process had grown by 5.5 MiB beyond the cold entries)."""
    total = llama_memory(ctx).compute
    unused = (n_ubatch - 1) * n_vocab * 4
    if not all_outputs and total > unused:  # smaller: not the graph this reasons about, nothing discounted
        total -= unused
    return total + scores_bytes


def drop_page_cache(path: Path) -> None:
    """Asks the kernel to drop a file's cached pages (a budgeted load reads the model once, buffered)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class BudgetUse:
    """Where a memory budget went when the cache was sized, item by item (bytes), the caches last."""

    budget: int
    items: tuple[tuple[str, int], ...]
    cache: int  # the neuron cache's hot and cold segments and the expert cache

    def to_json(self) -> dict[str, object]:
        return {"budget": self.budget, "items": [list(i) for i in self.items], "cache": self.cache}

    @classmethod
    def from_json(cls, d: dict) -> BudgetUse:
        return cls(int(d["budget"]), tuple((str(n), int(b)) for n, b in d["items"]), int(d["cache"]))

    @property
    def unused(self) -> int:
        """What the caches could have had and did not need (every bundle cached), or the plan's rounding."""
        return max(self.budget - sum(size for _, size in self.items) - self.cache, 0)

    def line(self) -> str:
        parts = ", ".join(f"{name} {size / 1e6:.0f}" for name, size in self.items)
        # what is left is either more than every bundle needs or less than one more entry (an expert cache's are whole
        # experts): the line cannot tell which, so it says both
        unused = (f", {self.unused / 1e6:.0f} MB unused (every bundle cached, or less than one more cache entry)"
                  if self.unused >= 1_000_000 else "")
        return (f"budget {self.budget / 1e6:.0f} MB: {parts} MB; the caches got {self.cache / 1e6:.0f} MB "
                f"({self.cache / self.budget:.0%} of the budget){unused}")


def budget_use(info: CacheInfo, mem: LlamaMemory) -> BudgetUse:
    """Itemizes the budget from the plugin's accounting when it sized the cache (info) and llama.cpp's own report
    (mem): the resident memory split into llama.cpp's weights in RAM (its buffers other than PI2's, which hold no
    weights under a budget), its KV cache, the predictors and the rest (Python, libraries, heap)."""
    weights = mem.model_except("PI2")
    kv = mem.context
    runtime = max(info.resident_bytes - weights - kv - info.fixed_bytes - info.output_copy_bytes, 0)
    cache = info.hot_bytes + info.cold_bytes + info.expert_bytes
    items = [("runtime (Python, libraries, heap)", runtime), ("llama.cpp's weights in RAM", weights), ("KV cache", kv),
             ("output matrix copy", info.output_copy_bytes), ("predictors", info.fixed_bytes),
             ("compute buffers", info.reserved_bytes),
             ("cache tables", info.tables_bytes), ("margin", info.margin_bytes)]
    return BudgetUse(info.budget_bytes, tuple(items), cache)
