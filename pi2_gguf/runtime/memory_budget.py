"""Memory budgets: parsing "600MB", the lower bound a model needs before it loads, llama.cpp's compute
buffer sizes as llama reports them, and the page cache a budgeted load leaves behind.

The budget bounds the whole process. After the model and context exist, the plugin measures this
process's resident memory (llama's non-FFN weights, KV cache, predictors, Python), subtracts it and the
compute buffers captured here, and makes the rest the neuron cache (pi2_binding_set_budget)."""

from __future__ import annotations

import ctypes
import gc
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import MemoryBudgetError
from .plugin import ModelSummary

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")
MARGIN = 32 << 20  # PI2_BUDGET_MARGIN in model_binding.h


def parse_size(value: str | int | float) -> int:
    """Bytes from 600MB / 0.6GB (powers of 10), 512MiB (powers of 2) or a plain number of bytes; the same
    units as PI2_MEMORY_BUDGET in the plugin."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise MemoryBudgetError(f"memory budget {value} is not a positive size")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise MemoryBudgetError(f"memory budget '{value}' is not a size (e.g. 600MB, 2GiB, 1500000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resident_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def precheck(budget: int, model: ModelSummary, path: Path, sidecar: Path) -> None:
    """Refuses, before anything loads, a budget below what the model needs at the very least: what this
    process holds now, the model's resident non-FFN weights, one layer of bundles and the margin (the
    plugin states the exact minimum, with the predictors it keeps, KV cache and compute buffers, after
    the load). A token embedding apart from the output matrix stays in the model file (the plugin reads
    its rows per token), so it does not count."""
    from ..sidecar import reader as sidecar_mod

    gc.collect()  # unmaps what GGUF readers the caller dropped still map: mapped pages count as resident
    held = resident_bytes()  # before the reader below maps (and counts) file pages
    non_ffn = model.file_size - model.ffn_bytes - model.embedding_bytes
    kv = sidecar_mod.read(sidecar).kv
    one_layer = max(-(-int(f) // int(g)) * int(b)
                    for f, g, b in zip(kv["pi2.n_ff"], kv["pi2.bundle.neurons"], kv["pi2.bundle.size"]))
    need = held + non_ffn + one_layer + MARGIN
    if budget < need:
        raise MemoryBudgetError(
            f"memory budget {budget / 1e6:.0f} MB is too small for {path.name}: it needs more than {need / 1e6:.0f} MB "
            f"(this process {held / 1e6:.0f} MB, resident non-FFN weights {non_ffn / 1e6:.0f} MB, neuron cache at "
            f"least {one_layer / 1e6:.0f} MB, margin {MARGIN / 1e6:.0f} MB; plus predictors, KV cache and compute "
            "buffers)")


_COMPUTE = re.compile(r"compute buffer size\s*=\s*([0-9.]+)\s*MiB")


@contextmanager
def compute_buffer_log() -> Iterator[list[int]]:
    """Collects the compute buffer sizes llama.cpp logs while a context is created (bytes, one per
    backend); the log still reaches llama-cpp-python's own handler."""
    import llama_cpp
    from llama_cpp import _logger

    sizes: list[int] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        m = _COMPUTE.search(text.decode("utf-8", "replace"))
        if m:
            sizes.append(int(float(m.group(1)) * 2**20))
        _logger.llama_log_callback(level, text, user_data)

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        yield sizes
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def compute_reserve(compute: list[int], n_vocab: int, n_ubatch: int, all_outputs: bool, scores_bytes: int) -> int:
    """What llama will still touch after the budget is read: its compute buffers and, with logits_all,
    the scores array. llama sizes the compute buffer for a batch whose every token has an output, but
    llama-cpp-python asks for the last token's logits only (unless logits_all or embeddings), so the
    other n_ubatch - 1 rows of the logits tensor are never touched (Qwen2.5-1.5B at n_batch 32: 18.5 of
    the 22 MiB; after a prompt and 16 tokens the process had grown by 5.5 MiB beyond the cold entries)."""
    total = sum(compute)
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
