"""What llama.cpp allocated for a context, as llama.cpp reports it: weight buffers, context memory (KV cache) and
compute buffers, in bytes summed over its buffer types. A memory budget reserves the compute buffers from this.

llama.cpp states these through llama_get_memory_breakdown, a C++ function of its staging API (llama-ext.h) that
returns a std::map; ctypes cannot call it, so the small C++ helper built beside the plugin
(ggml-backend/host/llama_memory.cpp, libpi2-llama-memory.so) does, given the function's address in the libllama
llama_cpp loaded (the very copy the process runs)."""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, Structure, c_int, c_uint64, c_void_p
from dataclasses import dataclass

from ..errors import PluginError
from .capi import plugin_path

HELPER_FILE = "libpi2-llama-memory.so"
# llama_get_memory_breakdown(const llama_context *) under the Itanium C++ ABI (GCC and Clang on Linux); the helper's
# static_assert pins the signature to the header it is compiled against
BREAKDOWN_SYMBOL = "_Z26llama_get_memory_breakdownPK13llama_context"


class _Entry(Structure):  # struct pi2_llama_memory (host/llama_memory.cpp)
    _fields_ = [("buft", c_void_p), ("model", c_uint64), ("context", c_uint64), ("compute", c_uint64)]


@dataclass(frozen=True)
class BufferMemory:
    buffer_type: str  # ggml's name of the buffer type: "CPU", "PI2", ...
    model: int        # weight buffers by their size (a PI2 flash buffer's size, not what of it is resident)
    context: int      # KV cache and other per-context memory
    compute: int      # compute buffers llama's scheduler reserved


@dataclass(frozen=True)
class LlamaMemory:
    buffers: tuple[BufferMemory, ...]

    @property
    def compute(self) -> int:
        return sum(b.compute for b in self.buffers)

    @property
    def context(self) -> int:
        return sum(b.context for b in self.buffers)

    @property
    def model(self) -> int:
        return sum(b.model for b in self.buffers)

    def model_except(self, prefix: str) -> int:
        """Weight buffers of every buffer type whose name does not start with prefix (PI2's hold no weights
        under a budget: they reserve address space only)."""
        return sum(b.model for b in self.buffers if not b.buffer_type.startswith(prefix))


_lock = threading.Lock()
_helper: tuple[ctypes.CDLL, int] | None = None


def _open() -> tuple[ctypes.CDLL, int]:
    global _helper
    with _lock:
        if _helper is None:
            from llama_cpp import llama_cpp as lc

            path = plugin_path().with_name(HELPER_FILE)
            if not path.is_file():
                raise PluginError(f"{HELPER_FILE} not found beside the PI2 plugin in {path.parent}; rebuild with "
                                  "tools/bootstrap.py")
            lib = ctypes.CDLL(str(path))
            lib.pi2_llama_memory_get.restype = c_int
            lib.pi2_llama_memory_get.argtypes = [c_void_p, c_void_p, POINTER(_Entry), c_int]
            try:
                fn = ctypes.cast(getattr(lc._lib, BREAKDOWN_SYMBOL), c_void_p).value
            except AttributeError as e:
                raise PluginError(f"this llama.cpp exports no llama_get_memory_breakdown ({BREAKDOWN_SYMBOL}): "
                                  "pi2-gguf needs llama-cpp-python 0.3.36's") from e
            assert fn is not None
            _helper = (lib, fn)
        return _helper


def llama_memory(ctx: int | ctypes.c_void_p) -> LlamaMemory:
    """llama.cpp's own report of what the context `ctx` (a llama_context pointer) and its model allocated, a
    buffer type at a time."""
    from .ggml_base import lib as ggml

    lib, fn = _open()
    entries = (_Entry * 16)()
    n = lib.pi2_llama_memory_get(fn, ctx, entries, len(entries))
    if n < 0:
        raise PluginError(f"llama_get_memory_breakdown failed ({'no context' if n == -1 else 'llama.cpp threw'})")
    if n > len(entries):
        entries = (_Entry * n)()
        n = lib.pi2_llama_memory_get(fn, ctx, entries, n)
    g = ggml()
    return LlamaMemory(tuple(BufferMemory((g.ggml_backend_buft_name(e.buft) or b"?").decode(), int(e.model),
                                          int(e.context), int(e.compute)) for e in entries[:n]))
