"""A llama.cpp model and context driven through llama-cpp-python's C API, for tools that need more
than the high-level Llama class offers: an eval callback on named graph tensors (profiling) and the
logits of every token of a window (perplexity)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import llama_cpp as lc
import numpy as np

from ..errors import Pi2Error, SidecarError
from ..gguf_file import check_model_file, load_failure
from . import ggml_base
from . import memory_budget as budgets


class _TensorHead(ctypes.Structure):
    # the leading fields of struct ggml_tensor (ggml.h); the layout is pinned with llama-cpp-python
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


GGML_TYPE_F32 = 0


# Called with (layer, tensor name without the layer suffix, array [n_tokens, ne0]) for every graph
# tensor named "<name>-<layer>" whose name is in the watched set.
TensorSink = Callable[[int, str, np.ndarray], None]


class LlamaRunner:
    def __init__(self, model_path: str | Path, n_ctx: int = 512, n_threads: int | None = None,
                 watch: Iterable[str] = (), sink: TensorSink | None = None, all_logits: bool = False,
                 use_mmap: bool = True, verbose: bool = False, sidecar: str | Path | None = None,
                 mode: str = "dense", n_ubatch: int | None = None,
                 settings: Mapping[str, str | int | float | bool] | None = None, repack: bool = True,
                 memory_budget: int | None = None) -> None:
        """sidecar/mode: bind the model to a pi2 sidecar in the PI2 plugin (registered by the caller).
        memory_budget: the FFN stays on flash as under pi2_gguf.Llama's budget, the neuron cache sized from it once
        the context exists, llama's compute buffers reserved as pi2_gguf.Llama reserves them; loads without mmap.
        repack: llama's CPU weight repacking (its default); off, prompt batches of Q4_K models ran faster here.
        n_ubatch: llama's micro-batch; a small one makes every micro-batch a sparse decode batch.
        settings: PI2_* settings for the binding (without a sidecar: the defaults), as pi2_gguf.Llama's."""
        path = check_model_file(model_path)
        self._binding = 0
        self.n_ctx = n_ctx
        self.all_logits = all_logits
        self._watch = frozenset(watch)
        # every token of a batch has an output (logits, and the watched tensors of every token)
        self._all_outputs = all_logits or bool(self._watch)
        self._sink = sink
        self._error: BaseException | None = None
        self._ggml = ggml_base.lib()
        from llama_cpp._logger import set_verbose

        set_verbose(verbose)  # llama-cpp-python's log callback; quiet unless asked
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        if not use_mmap or memory_budget is not None:  # a budget's FFN must not be mapped (the plugin refuses it)
            mp.load_mode = lc.LLAMA_LOAD_MODE_NONE
        mp.use_extra_bufts = repack
        from . import plugin

        if memory_budget is not None and sidecar is None:
            raise Pi2Error(budgets.no_sidecar(path))
        # with PI2 in the process it is told the model, whose stated FFN activation it then computes
        if sidecar is not None or mode != "dense" or settings or plugin.is_registered():
            with plugin.model_load(sidecar, mode, flash=memory_budget is not None, model=path,
                                   settings=settings) as self._binding:
                self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        else:
            self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            self._release_binding()
            raise load_failure(path)
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_layer = lc.llama_model_n_layer(self.model)
        self.n_embd = lc.llama_model_n_embd(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = min(n_ubatch, n_ctx) if n_ubatch else n_ctx
        threads = n_threads or os.cpu_count() or 1
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        if self._watch:
            self._cb = lc.ggml_backend_sched_eval_callback(self._eval_callback)  # kept alive on self
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            self._release_binding()
            raise Pi2Error(f"llama.cpp could not create a context of {n_ctx} tokens for {path}")
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.bos = lc.llama_vocab_bos(self.vocab)
        if memory_budget is not None:
            why = plugin.binding_error(self._binding)
            try:
                if why:
                    raise SidecarError(why)
                # llama's compute buffers, as pi2_gguf.Llama counts them
                reserved = budgets.compute_reserve(self.ctx, self.n_vocab, cp.n_ubatch, self._all_outputs, 0)
                plugin.set_budget(self._binding, memory_budget, reserved)
            except Pi2Error:
                self.close()
                raise

    def close(self) -> None:
        if getattr(self, "ctx", None):
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None
        self._release_binding()

    def _release_binding(self) -> None:
        if getattr(self, "_binding", 0):
            from . import plugin

            plugin.release_binding(self._binding)
            self._binding = 0

    def binding_error(self) -> str:
        """Why the plugin refused to compute (e.g. a sidecar made for another model), or ''."""
        if not self._binding:
            return ""
        from . import plugin

        return plugin.binding_error(self._binding)

    def __enter__(self) -> LlamaRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, False, False)
        if n < 0:
            raise Pi2Error(f"tokenizer needs {-n} slots for a text of {len(data)} bytes")
        return list(buf[:n])

    def windows(self, documents: Iterable[str], max_tokens: int) -> Iterator[list[int]]:
        """Token windows of n_ctx tokens (BOS first if the model wants one) over the documents joined
        by blank lines, until max_tokens tokens have been handed out."""
        sep = self.tokenize("\n\n")
        body = self.n_ctx - (1 if self.add_bos else 0)
        head = [self.bos] if self.add_bos else []
        pending: list[int] = []
        given = 0
        for doc in documents:
            pending.extend(self.tokenize(doc))
            pending.extend(sep)
            while len(pending) >= body and given < max_tokens:
                w = head + pending[:body]
                del pending[:body]
                w = w[:max_tokens - given]
                given += len(w)
                yield w
            if given >= max_tokens:
                return
        if pending and given < max_tokens:
            yield (head + pending)[:max_tokens - given]

    def decode(self, tokens: list[int], outputs_from: int = 0) -> np.ndarray | None:
        """Evaluates one window from position 0 (the KV cache is cleared first). Returns the logits of
        every token from position outputs_from on [n - outputs_from, n_vocab] when all_logits, else None. Tokens
        before outputs_from have no output: llama.cpp skips their rows of the last layer and of the output matrix
        (a perplexity scores the second half of a window only)."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise ValueError(f"window of {n} tokens; the context holds {self.n_ctx}")
        if not 0 <= outputs_from < n or (outputs_from and (self._watch or not self.all_logits)):
            raise ValueError(f"outputs from token {outputs_from} of {n}: only all_logits runs without watched "
                             "tensors skip outputs")
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = int(i >= outputs_from) if self._all_outputs else int(i == n - 1)
        b.n_tokens = n
        rc = lc.llama_decode(self.ctx, b)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if rc != 0:
            why = self.binding_error()
            raise Pi2Error(why or f"llama_decode failed with code {rc}")
        if not self.all_logits:
            return None
        ptr = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n - outputs_from, self.n_vocab)).copy()

    def _eval_callback(self, t: int, ask: bool, user_data: int) -> bool:
        try:
            name = self._ggml.ggml_get_name(t).decode()
            base, _, layer = name.rpartition("-")
            if base not in self._watch or not layer.isdigit():
                return not ask  # not watched: do not ask for it; after computing, continue
            if ask:
                return True
            head = _TensorHead.from_address(t)
            if head.type != GGML_TYPE_F32:
                raise Pi2Error(f"graph tensor {name} is type {head.type}, expected F32")
            ne0, ne1 = int(head.ne[0]), int(head.ne[1])
            if head.nb[1] != 4 * ne0 or head.ne[2] != 1 or head.ne[3] != 1:
                raise Pi2Error(f"graph tensor {name} is not a contiguous 2-D F32 tensor")
            out = np.empty((ne1, ne0), dtype=np.float32)
            self._ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
            assert self._sink is not None
            self._sink(int(layer), base, out)
            return True
        except BaseException as e:  # noqa: BLE001 - an exception must not unwind through C; re-raised after decode
            self._error = e
            return False
