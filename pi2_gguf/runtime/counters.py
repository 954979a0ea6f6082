"""What the PI2 device reports: its counters (process-wide) and a flash binding's neuron cache."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import capi


@dataclass(frozen=True)
class Counters:
    """What the PI2 device executed since the last reset (process-wide). Arrays are [layer, matrix]
    with matrix 0 = gate, 1 = up, 2 = down."""

    graph_computes: int
    nodes_computed: int
    n_layers: int
    matmul_calls: np.ndarray
    matmul_tokens: np.ndarray
    rows: np.ndarray
    weight_bytes: np.ndarray
    glu_calls: np.ndarray
    glu_tokens: np.ndarray
    # sparse decode, per layer: tokens decoded sparsely, n_ff summed over them, neurons whose gate was
    # computed, neurons active,
    # tokens whose down ran by columns, tokens with the recall check, active neurons the predictor missed
    sparse_tokens: np.ndarray
    neurons: np.ndarray
    predicted: np.ndarray
    active: np.ndarray
    down_sparse_tokens: np.ndarray
    checked_tokens: np.ndarray
    missed: np.ndarray
    # flash-resident FFN (memory budget), per layer: bundles found in the hot segment, in the cold
    # segment, read from the sidecar; bytes read; read requests; time the threads waited (ns, per thread);
    # of the misses, those read ahead while the layer before finished
    hot_hits: np.ndarray
    cold_hits: np.ndarray
    misses: np.ndarray
    bytes_read: np.ndarray
    io_requests: np.ndarray
    io_wait_ns: np.ndarray
    prefetched: np.ndarray
    # routed experts (MoE layers), per layer: tokens through them, (token, expert) pairs computed (n_expert_used
    # a token), distinct experts computed per batch (summed), n_ff over the pairs, of those the neurons whose
    # ReLU-family gate fired (their up row computed; all of them for other activations)
    expert_tokens: np.ndarray
    experts_routed: np.ndarray
    experts_loaded: np.ndarray
    expert_neurons: np.ndarray
    expert_active: np.ndarray
    # flash (a memory budget): routed pairs whose wanted bundles were all in the neuron cache (hits), or not
    expert_hits: np.ndarray
    expert_misses: np.ndarray
    # flash, PI2_EXPERT_GUESS: experts read ahead for a layer on the next-layer router's guess while the layer before
    # computed, and of the distinct experts its batches routed to, those guessed (recall: / experts_loaded)
    experts_guessed: np.ndarray
    experts_guessed_routed: np.ndarray
    # a sparse output layer (PI2_OUTPUT_ROWS under a memory budget): exact rows read from the model file, bytes
    output_rows: int = 0
    output_bytes: int = 0

    def active_per_token(self) -> np.ndarray:
        """Mean active neurons per sparsely decoded token, per layer (nan where none ran sparse)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active.astype(float) / self.sparse_tokens.astype(float)

    def recall(self) -> np.ndarray:
        """Per layer, on checked tokens: active neurons the predictor selected / all active neurons."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active.astype(float) / (self.active + self.missed).astype(float)


_PER_MATRIX = ("matmul_calls", "matmul_tokens", "rows", "weight_bytes")


def read_counters() -> Counters:
    """The device's counters now."""
    raw = capi.Pi2Counters()
    capi.lib().pi2_counters_read(ctypes.byref(raw))
    n = int(raw.n_layers)
    layers = raw.layer[:n]
    fields: dict[str, np.ndarray] = {}
    for name, *_ in capi.Pi2LayerCounters._fields_:
        if name in _PER_MATRIX:
            fields[name] = np.array([list(getattr(lc, name)) for lc in layers], dtype=np.uint64).reshape(n, capi.N_MATRIX)
        else:
            fields[name] = np.array([getattr(lc, name) for lc in layers], dtype=np.uint64)
    return Counters(graph_computes=int(raw.graph_computes), nodes_computed=int(raw.nodes_computed), n_layers=n,
                    output_rows=int(raw.output_rows), output_bytes=int(raw.output_bytes), **fields)


def reset_counters() -> None:
    capi.lib().pi2_counters_reset()


@dataclass(frozen=True)
class CacheInfo:
    """The neuron cache of a model with a memory budget: segment sizes (bytes), hot neurons (all layers),
    cold entries, whether reads bypass the page cache, time spent in its FFN layers, the bytes of token
    embedding left in the model file (read per token; 0 when it is in RAM), the cold entries kept for
    prefetching the next layer's first bundles, whether reads go through io_uring, and the expert cache of routed
    experts read whole from the model file (PI2_EXPERT_READS=model; 0 entries: none)."""

    fixed_bytes: int
    hot_bytes: int
    cold_bytes: int
    hot_neurons: int
    n_cold: int
    direct_io: bool
    freq_cutoff: float
    ffn_seconds: float
    embedding_bytes: int
    n_prefetch: int
    io_ring: bool  # bundle reads through io_uring (PI2_IO_ENGINE=uring where the kernel allows), else I/O threads
    expert_entries: int = 0
    expert_bytes: int = 0
    # how the budget was spent when the cache was sized (memory_budget.budget_use itemizes it)
    budget_bytes: int = 0
    resident_bytes: int = 0   # the process then: llama.cpp's weights and KV cache, the predictors, the runtime
    reserved_bytes: int = 0   # llama's compute buffers (the part it touches)
    tables_bytes: int = 0     # the cache's tables
    margin_bytes: int = 0
    output_copy_bytes: int = 0  # of the resident memory: the output matrix's in-RAM copy (PI2_OUTPUT_ROWS)


def cache_info(binding: int) -> CacheInfo | None:
    """The binding's neuron cache; None for a binding without one."""
    raw = capi.Pi2CacheInfo()
    if capi.lib().pi2_binding_cache_info(binding, ctypes.byref(raw)) != 0:
        return None
    return CacheInfo(int(raw.fixed_bytes), int(raw.hot_bytes), int(raw.cold_bytes), int(raw.hot_neurons),
                     int(raw.n_cold), bool(raw.direct_io), float(raw.freq_cutoff), raw.ffn_ns / 1e9,
                     int(raw.embd_bytes), int(raw.n_prefetch), bool(raw.io_ring), int(raw.n_expert_entries),
                     int(raw.expert_bytes), int(raw.budget_bytes), int(raw.resident_bytes), int(raw.reserved_bytes),
                     int(raw.tables_bytes), int(raw.margin_bytes), int(raw.output_copy_bytes))
