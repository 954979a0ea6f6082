"""What a model and its sidecar tell the planner: per FFN layer the bundles (size, neurons, how often a decode token
requests each: the profiled neuron frequencies `pi2_freq` scaled to the predictor's density where the predictor runs,
every bundle where it does not), the weight bytes a token computes, and what a memory budget gives to everything but
the neuron cache (the plugin's floor, native.budget_floor, plus the predictors kept, the KV cache and llama's compute
buffers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import Pi2Error
from ..gguf_file import header_tensors
from ..sidecar import format as fmt
from ..sidecar.format import Key
from ..sidecar.reader import Sidecar

BUDGET_MARGIN = 16 << 20    # flash/memory_budget.h, PI2_BUDGET_MARGIN
PREFETCH_BYTES = 8 << 20    # PI2_PREFETCH_BYTES' default
CACHE_TABLE_BYTES = 64      # per bundle: bundle map, entry, frequencies (pi2_cache_overhead_bytes, about)
N_UBATCH = 32               # memory_budget.N_BATCH: llama's compute buffers are sized by it under a budget


class PlanError(Pi2Error):
    """The planner cannot model this model or sidecar (the message says why)."""


def type_name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


@dataclass
class LayerStats:
    n_ff: int
    bundle_size: int
    neurons: int             # per bundle
    want: np.ndarray         # [n_bundles], slot (= file) order: chance a decode token requests the bundle
    freq: np.ndarray         # [n_bundles]: the cache plan's hotness, the bundle's first slot's profiled frequency
    predictor_runs: bool     # PI2_PREDICTOR=auto: where its bytes are below the bundle bytes it saves
    predictor_bytes: int     # kept in RAM under a budget where it runs (as the plugin keeps it: predictor_decode_types)
    density: float
    pred_density: float
    dense_bytes: int         # gate, up and down of every neuron in the bundles' types
    cost: float              # the plugin's sparse / dense time estimate for the layer (pi2_sidecar_sparse_cost)
    gate_type: str
    # the model file's gate, up and down (type name, bytes): what the layer computes where a budget reads it whole
    model_weights: tuple[tuple[str, int], ...] = ()

    @property
    def n_bundles(self) -> int:
        return int(self.want.size)


@dataclass
class ModelStats:
    model: Path
    sidecar: Path
    layers: list[LayerStats]
    non_ffn_budget: dict[str, int]   # type -> weight bytes a token computes outside the FFN under a budget
    non_ffn_ram: dict[str, int]      # the same without a budget (the output matrix whole)
    fixed: dict[str, int]            # what a budget gives to all but the neuron cache, by item
    read_extra: int                  # bytes a token reads besides bundles (embedding row, exact output rows)
    ram_bytes: int                   # a run without a budget: the process with every weight in RAM
    relu_family: bool
    types: dict[str, int] = field(default_factory=dict)  # type name -> ggml type, the types compute is timed on
    # cache bytes -> (per layer: read whole from the model file, the cache those layers take): the plugin's rule, asked
    _whole: dict[int, tuple[tuple[bool, ...], int]] = field(default_factory=dict, repr=False)

    def whole_reads(self, cache_bytes: int) -> tuple[tuple[bool, ...], int]:
        """The layers a budget whose caches get cache_bytes reads whole from the model file instead of their bundles
        (PI2_DENSE_READS=auto; the plugin's own rule, native.dense_whole_layers), and the cache bytes they take."""
        got = self._whole.get(cache_bytes)
        if got is None:
            from ..runtime import native

            pick, whole = native.dense_whole_layers(self.model, self.sidecar, cache_bytes)
            got = self._whole[cache_bytes] = (tuple(pick[:len(self.layers)]), whole)
        return got

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    @property
    def entry(self) -> int:
        """A cold entry: as large as the largest bundle (pi2_cache_entry_size)."""
        return max(L.bundle_size for L in self.layers)

    @property
    def max_n_bundles(self) -> int:
        return max(L.n_bundles for L in self.layers)

    @property
    def min_cache(self) -> int:
        """The smallest neuron cache: one layer's bundles in cold entries (pi2_cache_min_bytes)."""
        return self.max_n_bundles * self.entry

    @property
    def bundle_bytes(self) -> int:
        return sum(L.n_bundles * L.bundle_size for L in self.layers)

    @property
    def prefetch_entries_wanted(self) -> int:
        """Cold entries kept for prefetching the next layer where some layer reads every bundle (PI2_PREFETCH_BYTES)."""
        return PREFETCH_BYTES // self.entry if any(not L.predictor_runs for L in self.layers) else 0

    @property
    def min_budget(self) -> int:
        return self.fixed_bytes + self.min_cache

    def all_hot_budget(self) -> int:
        """The least budget whose cache plan makes every bundle hot (nothing read per token)."""
        n_pf = self.prefetch_entries_wanted
        need = self.bundle_bytes + n_pf * self.entry
        # the prefetch room is at most a quarter of what the cache has beyond one layer
        return self.fixed_bytes + need

    def top_budget(self) -> int:
        """The least budget past which more memory changes nothing: every bundle hot or, where the plugin reads layers
        whole from the model file once they fit beside the other layers' bundles, every layer it may read so."""
        pick, whole = self.whole_reads(1 << 62)
        if whole == 0:
            return self.all_hot_budget()
        rest = sum(L.n_bundles * L.bundle_size for L, p in zip(self.layers, pick) if not p)
        return max(self.all_hot_budget(), self.fixed_bytes + whole + rest)


def want_probabilities(freq_slots: np.ndarray, neurons: int, density: float, pred_density: float,
                       predictor_runs: bool) -> np.ndarray:
    """Per bundle, the chance a token requests it: every bundle without a predictor; with one, each neuron's profiled
    frequency (slot order) scaled so that the layer's expected requested neurons match the predictor's held-out
    density (its predicted set is a superset of the active neurons, the frequent ones first), neurons of a bundle
    taken as independent."""
    n = freq_slots.size
    n_b = -(-n // neurons)
    if not predictor_runs:
        return np.ones(n_b)
    f = np.clip(freq_slots.astype(np.float64), 0.0, 1.0)
    target = min(max(pred_density, 0.0), 1.0) * n
    q = f.copy()
    if q.sum() > 0 and target > 0:
        for _ in range(8):  # scale to the target, the neurons at 1 held there
            s = q.sum()
            if abs(s - target) < 1e-6 * n:
                break
            free = q < 1.0
            room = target - (n - free.sum())
            part = q[free].sum()
            if part <= 0 or room <= 0:
                break
            q[free] = np.minimum(q[free] * room / part, 1.0)
    pad = np.ones(n_b * neurons)
    pad[:n] = 1.0 - q
    pad[n:] = 1.0
    return 1.0 - pad.reshape(n_b, neurons).prod(axis=1)


def _predictor_weight_bytes(n_embd: int, n_ff: int, rank: int, w2_type: str) -> int:
    """The predictor's two matrices as a budget keeps them (sidecar/format.predictor_decode_types)."""
    w1, w2 = fmt.predictor_decode_types(n_embd, n_ff, rank, w2_type)
    return rank * fmt.row_size(w1, n_embd) + rank * fmt.row_size(w2, n_ff)


def predictor_bytes(n_embd: int, n_ff: int, rank: int, w2_type: str) -> int:
    """The predictor as a budget keeps it, biases too."""
    return _predictor_weight_bytes(n_embd, n_ff, rank, w2_type) + 4 * (rank + n_ff)


def predictor_pays(n_embd: int, n_ff: int, rank: int, bundle_bytes: int, pred_density: float, w2_type: str) -> bool:
    """pi2_predictor_pays: its bytes (all of w2 counted) below the bundle bytes it saves (bundle_bytes: the layer's
    bundles, all of them)."""
    return _predictor_weight_bytes(n_embd, n_ff, rank, w2_type) < (1.0 - pred_density) * bundle_bytes


def layer_stats(sc: Sidecar, cost: Sequence[float]) -> list[LayerStats]:
    kv = sc.kv
    if kv.get(Key.MOE_EXPERT_COUNT):
        raise PlanError(f"sidecar {sc.path} is of an MoE model: `pi2-gguf plan` models dense FFN models for now "
                        "(routed experts' reads depend on routing locality it does not model yet); measure an MoE "
                        "model with `pi2-gguf bench`")
    n_embd = int(kv[Key.N_EMBD])
    w2_type = str(kv.get(Key.PREDICTOR_W2_TYPE, fmt.PREDICTOR_W2_TYPES[0]))
    out = []
    for il in range(sc.n_layer):
        n_ff = int(kv[Key.N_FF][il])
        gate_t = int(kv[Key.BUNDLE_GATE_TYPE][il])
        rank = int(kv[Key.PREDICTOR_RANK][il])
        pd = float(kv[Key.PREDICTOR_DENSITY][il])
        neurons = int(kv[Key.BUNDLE_NEURONS][il])
        bundle_size = int(kv[Key.BUNDLE_SIZE][il])
        runs = predictor_pays(n_embd, n_ff, rank, -(-n_ff // neurons) * bundle_size, pd, w2_type)
        freq = sc.layer_tensor(il, "pi2_freq").astype(np.float64).reshape(-1)
        order = sc.layer_tensor(il, "pi2_order").astype(np.int64).reshape(-1)
        ranked = freq[order]
        dense = n_ff * sum(fmt.row_size(int(kv[k][il]), n_embd)
                           for k in (Key.BUNDLE_GATE_TYPE, Key.BUNDLE_UP_TYPE, Key.BUNDLE_DOWN_TYPE))
        out.append(LayerStats(
            n_ff=n_ff, bundle_size=bundle_size, neurons=neurons,
            want=want_probabilities(ranked, neurons, float(kv[Key.SPARSITY_DENSITY][il]), pd, runs),
            freq=ranked[::neurons].copy(), predictor_runs=runs,
            predictor_bytes=predictor_bytes(n_embd, n_ff, rank, w2_type) if runs else 0,
            density=float(kv[Key.SPARSITY_DENSITY][il]), pred_density=pd, dense_bytes=dense, cost=float(cost[il]),
            gate_type=type_name(gate_t)))
    return out


def vocabulary_bytes(model: Path) -> int:
    """Resident bytes llama.cpp's vocabulary of the model adds to a process: measured by loading it alone (no
    weights, no context) and freeing it again."""
    from ..runtime import native
    from ..runtime.llama import vocab_only_model

    before = native.resident_bytes()
    with vocab_only_model(model):
        return max(native.resident_bytes() - before, 0)


def model_stats(model: Path, sidecar: Path, ctx: int, cost: Sequence[float] | None = None,
                output_rows: int | None = None) -> ModelStats:
    """The statistics of a model and its sidecar (the sidecar checked to be this model's by the caller)."""
    import gc

    from ..runtime import native
    from ..sidecar.reader import read

    gc.collect()  # the floor counts this process as it is now: before the files below are read
    floor = native.budget_floor(model, sidecar, output_rows)
    sc = read(sidecar)
    relu = sc.kv[Key.ACTIVATION] in fmt.RELU_FAMILY
    layers = layer_stats(sc, native.sparse_cost_c(sidecar) if cost is None else cost)
    rows = output_rows if output_rows is not None else int(sc.kv.get(Key.BUDGET_OUTPUT_ROWS, 0) or 0)
    copy = str(sc.kv.get(Key.BUDGET_OUTPUT_COPY, "q3_k"))
    n_embd = int(sc.kv[Key.N_EMBD])
    arch = str(sc.kv[Key.SOURCE_ARCHITECTURE])
    del sc
    keys = {f"{arch}.{k}" for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                      "embedding_length", "attention.key_length", "attention.value_length")}
    kv, infos = header_tensors(model, keys)
    get = lambda k: int(kv[f"{arch}.{k}"]) if isinstance(kv.get(f"{arch}.{k}"), int) else None  # noqa: E731
    tensors = {t.name: t for t in infos}
    tied = "output.weight" not in tensors
    ram: dict[str, int] = {}
    budget: dict[str, int] = {}
    read_extra = 0

    def add(d: dict[str, int], qtype: int, nbytes: int) -> None:
        d[type_name(qtype)] = d.get(type_name(qtype), 0) + nbytes

    for name, t in tensors.items():
        if any(f".{p}." in name or f".{p}_" in name for p in ("ffn_gate", "ffn_up", "ffn_down")):
            continue  # the FFN (dense, fused, experts, shared experts): the bundles' part
        if name == "token_embd.weight":
            read_extra += fmt.row_size(t.qtype, n_embd)  # one row a token, read from the file under a budget
            if not tied:
                continue
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            add(ram, t.qtype, t.n_bytes)
            # a tied table too: the output MUL_MAT's duplicate is read row by row as well; the copy as the plugin
            # makes it (none where no type is smaller: the matrix stays in RAM)
            got = native.output_copy_size(model, copy == "q2_k") if rows > 0 else None
            if got is not None:
                add(budget, got[0], got[1])
                read_extra += rows * fmt.row_size(t.qtype, n_embd)
            else:
                add(budget, t.qtype, t.n_bytes)
            continue
        add(ram, t.qtype, t.n_bytes)
        add(budget, t.qtype, t.n_bytes)
    n_layer_model = get("block_count") or len(layers)
    n_head = get("attention.head_count") or 1
    n_head_kv = get("attention.head_count_kv") or n_head
    emb = get("embedding_length") or n_embd
    k_len = get("attention.key_length") or emb // n_head
    v_len = get("attention.value_length") or emb // n_head
    n_vocab = tensors["token_embd.weight"].shape[1] if "token_embd.weight" in tensors else 0
    file_size = model.stat().st_size
    kv_cache = n_layer_model * ctx * n_head_kv * (k_len + v_len) * 2  # F16
    n_ff_max = max(L.n_ff for L in layers)
    # llama's compute buffers at n_ubatch 32 (their logits rows but the last discounted, memory_budget.compute_reserve):
    # a batch's activations, the attention scores and one row of logits; an estimate, the plugin reads the real ones
    compute = N_UBATCH * 4 * (8 * emb + 3 * n_ff_max) + N_UBATCH * ctx * n_head * 4 + n_vocab * 4
    # the process: this one now (Python, llama_cpp, the plugin) and llama.cpp's vocabulary, which a run loads and this
    # process has not (measured: SmolLM2 17 MB, Qwen2.5's 152k tokens 40 MB; without it the planner counted 20 and
    # 51 MB less than `budget_use` showed those runs hold); the weights a budget keeps in RAM as the plugin keeps them
    # (the output matrix as its recorded copy)
    fixed = {"process": int(floor.resident) + vocabulary_bytes(model), "non-FFN weights": sum(budget.values()),
             "margin": int(floor.margin),
             "predictors": sum(L.predictor_bytes for L in layers), "KV cache": kv_cache,
             "compute buffers": compute, "cache tables": CACHE_TABLE_BYTES * sum(L.n_bundles for L in layers)}
    for il, L in enumerate(layers):
        mats = [tensors.get(f"blk.{il}.ffn_{m}.weight") for m in ("gate", "up", "down")]
        L.model_weights = tuple((type_name(t.qtype), int(t.n_bytes)) for t in mats if t is not None)
    types = {n: int(GGMLQuantizationType[n])
             for n in {*ram, *budget, *(L.gate_type for L in layers), *(t for L in layers for t, _ in L.model_weights),
                       "Q8_0"}
             if n not in ("F32", "I32")}
    ram_bytes = int(floor.resident) + file_size + kv_cache + compute
    return ModelStats(model, sidecar, layers, budget, ram, fixed, read_extra, ram_bytes, relu, types)
