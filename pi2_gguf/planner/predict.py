"""The prediction: for a memory budget, the neuron cache the plugin would make (its plan, ported from
`pi2_cache_plan`: the hottest bundles of the whole model pinned, cold entries for one layer's others), the bundles a
decode token then finds or reads, the bytes and requests those reads take (gaps bridged as PI2_IO_GAP does), and the
time a token takes on this machine.

Model of a token (2 threads unless told):
  - hot bundles always hit; cold entries (CLOCK) hit a bundle requested again within T tokens, T the number of tokens
    whose distinct cold requests the cold segment holds (Che's approximation, in whole tokens: a cold segment smaller
    than one token's misses gets no hits, as the layers sweep through it);
  - reads: misses sampled token by token from each bundle's request chance (a fixed seed: the same draws at every
    budget), merged into requests where the gap is at most PI2_IO_GAP, split at PI2_IO_MAX_BYTES;
  - a layer's read time: the first request's measured latency where it misses at all, then the requests and bytes at
    the measured concurrent rate (into huge pages, as the engine's cache is), and each iovec beyond a request's first
    at the measured cost of scattering a request into entries of the layer's bundle size: the CLOCK hand gives
    consecutive misses consecutive entries (one iovec), except where it steps over an entry recently hit, and a
    bridged gap lands in the scratch (one iovec more); its compute: its dense bytes at the measured dot-product rate
    times the plugin's own sparse/dense cost estimate; the reads the engine issued ahead (the next layer's first misses, as many as the
    prefetch room holds; none in a layer with predictors, whose reads wait for them) overlap the compute: the layer
    takes the longer of those two plus OVERLAP_REST of the shorter, and the rest of its reads after;
  - layers the plugin reads whole from the model file (PI2_DENSE_READS=auto: where they fit beside every other layer's
    bundles, its own rule asked through native.dense_whole_layers) read nothing after the first token and compute
    their model weights at the measured dot-product rate; the neuron cache is planned over the other layers;
  - outside the FFN: the other weights at the measured rate, plus a fixed cost per token and per layer.
Calibration (docs/MEASUREMENTS.md 2026-11-28, "Decode speed against the memory limit, and pi2-gguf plan against
bench"): FLASH_COMPUTE_FACTOR and OVERLAP_REST were fitted on eight bench points of Qwen2.5-Coder-1.5B and
SmolLM2-135M; the read model has no fitted constant since reads are measured into huge pages and scattered as the
engine scatters them (a gain of 2.2 over 4 KiB-page reads was fitted before that, and failed on a third model). The
two overheads stay 0."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .device import DeviceProfile
from .model_stats import ModelStats

IO_GAP = 32768            # PI2_IO_GAP's default
IO_MAX_BYTES = 1 << 20    # PI2_IO_MAX_BYTES's default
SAMPLED_TOKENS = 48
OVERLAP_REST = 0.5        # share of the shorter of a layer's compute and reads that does not overlap the longer
# Under a budget a layer computes from cache entries (a neuron's gate row, up row and down column together, down by
# columns), not streamed rows: Qwen with every bundle cached decoded 14-16 tok/s where streamed rows predict ~25
FLASH_COMPUTE_FACTOR = 1.4
REPACK_GAIN = 1.2         # ggml-cpu's repacked GEMV over one-row vec_dot (placement.c, PI2_COST_ROWS_IN_ORDER)
TOKEN_OVERHEAD_S = 0.0    # per token: llama's graph, sampling, Python
LAYER_OVERHEAD_S = 0.0    # per layer and token: the FFN's phases and barriers, attention over a short context


@dataclass
class CachePlan:
    hot_k: list[int]        # per layer, the first hot_k bundle slots are pinned
    hot_bytes: int
    n_cold: int             # cold entries, prefetch room included
    n_prefetch: int


@dataclass
class Prediction:
    budget: int
    cache_bytes: int
    hot_bytes: int
    cold_bytes: int
    hit_rate: float         # requested bundles found in the cache
    read_bytes: float       # a token: bundles (gaps included) and the other rows read from files
    requests: float         # read requests a token
    compute_s: float
    io_s: float
    token_s: float
    whole_layers: int = 0   # layers read whole from the model file (PI2_DENSE_READS=auto), in their cache entries
    whole_bytes: int = 0    # the cache those take

    @property
    def tps(self) -> float:
        return 1.0 / self.token_s if self.token_s > 0 else 0.0


def cache_plan(stats: ModelStats, cache_bytes: int, cold_share: float = 0.0,
               skip: Sequence[bool] | None = None) -> CachePlan:
    """pi2_cache_plan (flash/memory_budget.c): the longest prefix of the model's bundles, hottest first (ties by
    layer and slot), within (1 - cold_share) of the cache, that leaves cold entries for any layer's non-hot bundles
    and the prefetch room. skip: layers read whole from the model file, whose bundles the cache does not hold (and
    then no prefetch room: every other layer's bundles are hot)."""
    entry = stats.entry
    n_layer = len(stats.layers)
    reads = [not (skip is not None and skip[il]) for il in range(n_layer)]
    max_nb = max((L.n_bundles for L, r in zip(stats.layers, reads) if r), default=0)
    if max_nb == 0:  # every layer read whole: no neuron cache
        return CachePlan([0] * n_layer, 0, 0, 0)
    spare = max((cache_bytes // entry - max_nb) // 4, 0)
    n_pf = 0 if skip is not None else min(stats.prefetch_entries_wanted, spare)
    kept = [L if r else dataclasses.replace(L, want=L.want[:0], freq=L.freq[:0]) for L, r in zip(stats.layers, reads)]
    freq = np.concatenate([L.freq for L in kept])
    layer = np.concatenate([np.full(L.n_bundles, il) for il, L in enumerate(kept)])
    slot = np.concatenate([np.arange(L.n_bundles) for L in kept])
    order = np.lexsort((slot, layer, -freq))
    sizes = np.array([L.bundle_size for L in stats.layers], dtype=np.int64)[layer[order]]
    used = np.cumsum(sizes)                      # used[k - 1]: bytes of the first k items
    n = order.size
    # cold_need(k) = max over layers of (n_bundles - hot in the first k): the least v such that every layer has at
    # least n_bundles - v of its items among the first k, i.e. k >= K(v), K non-increasing in v
    pos_by_layer = [np.nonzero(layer[order] == il)[0] + 1 for il in range(n_layer)]  # 1-based positions, slot order
    v = np.arange(max_nb + 1)
    K = np.zeros(max_nb + 1, dtype=np.int64)
    for il, L in enumerate(kept):
        need = L.n_bundles - v                   # items of the layer that must be hot for rest <= v
        ok = need > 0
        K[ok] = np.maximum(K[ok], pos_by_layer[il][need[ok] - 1])
    ks = np.arange(1, n + 1)
    # smallest v with K(v) <= k: K is non-increasing, so count the v whose K(v) > k
    cold_need = np.searchsorted(-K, -ks, side="left")  # -K non-decreasing; v with -K[v] < -k, i.e. K[v] > k
    hot_cap = int((1.0 - cold_share) * cache_bytes)
    ok = (used <= hot_cap) & ((cache_bytes - used) // entry >= cold_need + n_pf)
    fits = np.nonzero(used <= hot_cap)[0]
    ok = ok[:fits[-1] + 1] if fits.size else ok[:0]
    best = int(np.nonzero(ok)[0][-1]) + 1 if ok.any() else 0
    hot_bytes = int(used[best - 1]) if best else 0
    hot_k = np.bincount(layer[order[:best]], minlength=n_layer).tolist()
    cold_entries = (cache_bytes - hot_bytes) // entry
    n_cold = int(min(cold_entries, n + n_pf))
    return CachePlan([int(h) for h in hot_k], hot_bytes, n_cold, int(n_pf))


def cold_horizon(want: np.ndarray, entries: int, limit: int = 4096) -> int:
    """T: the most whole tokens whose expected distinct requests among these bundles fit `entries` (0: not even one
    token's; `limit` when all of them fit)."""
    want = want[want > 0]
    if want.size == 0 or entries >= want.size:
        return limit
    miss = 1.0 - want
    lo, hi = 0, limit
    while lo < hi:  # D(t) = sum(1 - (1 - p)^t) grows with t
        mid = (lo + hi + 1) // 2
        if float(np.sum(1.0 - miss ** mid)) <= entries:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _reads(miss: np.ndarray, size: int, gap: int = IO_GAP, max_bytes: int = IO_MAX_BYTES,
           referenced: float = 0.0) -> tuple[float, float, float, float]:
    """(bytes, requests, iovecs, share of tokens with any request) of sampled misses [tokens, bundles] of one layer.
    The iovecs: the CLOCK hand hands consecutive misses consecutive entries, which merge into one iovec, except where
    it steps over an entry recently hit (a `referenced` share of them); each bridged gap lands in the scratch, an
    iovec of its own that also parts the entries on either side."""
    bridge = gap // size  # bundles between two misses a request reads through
    per_run = max(max_bytes // size, 1)
    total_b = total_r = total_v = 0.0
    any_miss = 0
    for row in miss:
        idx = np.flatnonzero(row)
        if idx.size == 0:
            continue
        any_miss += 1
        d = np.diff(idx) - 1
        starts = np.concatenate(([0], np.flatnonzero(d > bridge) + 1))
        ends = np.concatenate((starts[1:] - 1, [idx.size - 1]))
        span = idx[ends] - idx[starts] + 1
        total_b += float(span.sum()) * size
        total_r += float(np.sum(-(-span // per_run)))
        groups = 1 + np.count_nonzero(d > 0)  # runs of consecutive missed bundles
        total_v += groups + np.count_nonzero((d > 0) & (d <= bridge)) + (idx.size - groups) * referenced
    t = miss.shape[0]
    return total_b / t, total_r / t, total_v / t, any_miss / t


def _rate(device: DeviceProfile, stats: ModelStats, type_name: str, threads: int) -> float:
    """Weight bytes a second for a type, else the FFN's gate type's (types ggml cannot time stand in)."""
    for name in (type_name, stats.layers[0].gate_type, *sorted(device.compute)):
        name = name.split("@")[0]
        if any(k.split("@")[0] == name for k in device.compute):
            return device.compute_bps(name, threads)
    raise ValueError("no compute measurement")


def non_ffn_seconds(stats: ModelStats, device: DeviceProfile, threads: int, budget: bool) -> float:
    by_type = stats.non_ffn_budget if budget else stats.non_ffn_ram
    return sum(b / (_rate(device, stats, t, threads) * REPACK_GAIN) for t, b in by_type.items())


def predict(stats: ModelStats, device: DeviceProfile, budget: int, threads: int = 2, seed: int = 0) -> Prediction:
    """The predicted decode of one token under `budget` bytes (at least stats.min_budget)."""
    cache_bytes = max(budget - stats.fixed_bytes, stats.min_cache)
    # layers read whole from the model file where they fit beside every other layer's bundles (PI2_DENSE_READS=auto):
    # cached in entries of their own after the first token, computed by the plugin's dense kernels
    whole, whole_bytes = stats.whole_reads(cache_bytes)  # none picked: every layer False, 0 bytes
    plan = cache_plan(stats, cache_bytes - whole_bytes, skip=whole if whole_bytes else None)
    a, b = device.request_cost()
    layers = stats.layers
    hot = plan.hot_k
    # the cold segment over every layer's non-hot bundles
    rest = (np.concatenate([L.want[h:] for L, h, w in zip(layers, hot, whole, strict=True) if not w])
            if not all(whole) else np.zeros(0))
    horizon = cold_horizon(rest, max(plan.n_cold - plan.n_prefetch, 0))
    # the share of cold entries the CLOCK hand finds referenced: cold hits among cold requests
    cold_p = rest * (1.0 - (1.0 - rest) ** horizon)
    referenced = float(cold_p.sum() / rest.sum()) if rest.sum() > 0 else 0.0
    rng = np.random.default_rng(seed)
    needed = found = 0.0
    read_b = reqs = 0.0
    compute = io = total_layers = 0.0
    for L, h, w in zip(layers, hot, whole, strict=True):
        u = rng.random((SAMPLED_TOKENS, L.n_bundles))  # drawn for every slot: the same draws at every budget
        p = L.want
        if w:  # in its cache entry: nothing read, every weight computed at the plugin's dense rate
            needed += float(p.sum())
            found += float(p.sum())
            c = sum(nbytes / _rate(device, stats, t, threads) for t, nbytes in L.model_weights)
            compute += c
            total_layers += c + LAYER_OVERHEAD_S
            continue
        cold_hit = 1.0 - (1.0 - p[h:]) ** horizon
        miss_p = np.zeros_like(p)
        miss_p[h:] = p[h:] * (1.0 - cold_hit)
        lb, lr, lv, lany = _reads(u < miss_p, L.bundle_size, referenced=referenced)
        needed += float(p.sum())
        found += float(p.sum() - miss_p.sum())
        read_b += lb
        reqs += lr
        c = L.dense_bytes * L.cost * FLASH_COMPUTE_FACTOR / (_rate(device, stats, L.gate_type, threads) * REPACK_GAIN)
        c += L.predictor_bytes / (_rate(device, stats, "Q8_0", threads) * REPACK_GAIN)
        mean_req = lb / lr if lr > 0 else float(L.bundle_size)
        t_io = (lany * device.latency(mean_req) + max(lr - lany, 0.0) * a + max(lb - lany * mean_req, 0.0) * b
                + max(lv - lr, 0.0) * device.segment_cost(L.bundle_size))
        compute += c
        io += t_io
        # the share of the layer's misses read ahead, during the layer before: none in a layer with predictors (its
        # reads wait for them; drelu8 measured an I/O wait of the whole predicted read time), else what the prefetch
        # room holds of its expected misses (a cache of little more than one layer reads the rest when it is due)
        ahead = 0.0 if L.predictor_runs else min(1.0, plan.n_prefetch / max(float(miss_p.sum()), 1.0))
        t_ahead = t_io * ahead
        total_layers += max(c, t_ahead) + OVERLAP_REST * min(c, t_ahead) + (t_io - t_ahead) + LAYER_OVERHEAD_S
    other = non_ffn_seconds(stats, device, threads, budget=True)
    token = other + total_layers + TOKEN_OVERHEAD_S
    return Prediction(budget, cache_bytes, plan.hot_bytes, plan.n_cold * stats.entry,
                      found / needed if needed else 1.0, read_b + stats.read_extra, reqs, compute + other, io, token,
                      sum(whole), whole_bytes)


def predict_ram(stats: ModelStats, device: DeviceProfile, threads: int = 2) -> float:
    """Seconds a token without a budget (every weight in RAM): PI2 holds the layers it estimates faster sparse (all of
    a ReLU-family model's), ggml-cpu computes the others dense."""
    rate = lambda t: _rate(device, stats, t, threads) * REPACK_GAIN  # noqa: E731
    ffn = sum(L.dense_bytes * (L.cost if stats.relu_family else min(L.cost, 1.0)) / rate(L.gate_type)
              + (L.predictor_bytes / rate("Q8_0") if L.cost < 1.0 or stats.relu_family else 0.0) + LAYER_OVERHEAD_S
              for L in stats.layers)
    return ffn + non_ffn_seconds(stats, device, threads, budget=False) + TOKEN_OVERHEAD_S


def budget_steps(stats: ModelStats, n: int = 8) -> list[int]:
    """Budgets from the minimum to the top (every bundle hot, or every layer the plugin may read whole read so), n of
    them, rounded up to whole MB (to 4 KiB where the span is under 20 MB)."""
    lo, hi = stats.min_budget, stats.top_budget()
    unit = 1_000_000 if hi - lo >= 20_000_000 else 4096
    return sorted({-(-int(lo + (hi - lo) * i / (n - 1)) // unit) * unit for i in range(n)})


def load(model: Path, sidecar: Path, ctx: int, threads: int, remeasure: bool = False,
         progress: Callable[[str], None] | None = None,
         output_rows: int | None = None) -> tuple[ModelStats, DeviceProfile]:
    """The model's statistics and this machine's profile at the sizes and types the model needs."""
    from ..llama_build import cache_dir
    from . import device as device_mod
    from .model_stats import model_stats

    stats = model_stats(model, sidecar, ctx, output_rows=output_rows)
    sizes = device_mod.read_sizes([L.bundle_size for L in stats.layers], IO_MAX_BYTES)
    counts = sorted({1, threads})
    prof = device_mod.profile(sidecar, sizes, stats.types, counts, cache_dir(), remeasure, progress,
                              bundles=[L.bundle_size for L in stats.layers])
    return stats, prof


def predict_decode(model: Path, sidecar: Path, budgets: list[int], *, ctx: int = 512,
                   threads: int = 2) -> list[tuple[int, float]]:
    """(budget bytes, predicted decode tok/s) for each budget, as `pi2-gguf bench` runs them (2 threads, a context of
    512): for drawing the predicted line of a bench sweep. A budget below the minimum predicts 0."""
    stats, prof = load(Path(model), Path(sidecar), ctx, threads)
    out = []
    for b in budgets:
        out.append((int(b), 0.0 if b < stats.min_budget else predict(stats, prof, int(b), threads).tps))
    return out
