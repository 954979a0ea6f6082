"""What a model's activations (dense FFN neurons) or routing (MoE experts) look like over a text, in the terms the
published anchors use, so a benchmark model can be set beside a real one (tools/make_model.py prints them):

- skew: the fraction of units (neurons, experts) that carry 50 / 80 / 95% of all activations (firing events; a
  unit counts once a token it is active);
- temporal persistence: the lag-1 overlap (of a token's active units, the share active at the token before) and
  the union of the last 5 tokens' active units (its size as a fraction of the units, and the share of the next
  token's active units it holds);
- caches: hit rates, counted over the units each token actually needs, of a static hot set (the units a profile of
  other text ranked hottest), an LRU cache, and half of each (hot+LRU: the hottest half pinned, the other half LRU
  over the rest), at a cache of a given fraction of the units; from cold (empty caches, every token counted) and
  in steady state (the first tokens warm the caches and are not counted).

Published anchors (dense ReLU-family FFNs; experts of Qwen3-30B-A3B); [fit] marks a value of a generator fitted to
published ones by simulation, not measured on a model:

- TurboSparse-Mistral-7B-like [fit]: 12.7 / 30 / 52% of neurons carry 50 / 80 / 95% of activations; hot+LRU hits
  52 / 79 / 94% at 10 / 25 / 50% of the FFN cached (PowerInfer-2, arXiv 2406.06282, Fig. 14 measures 95% at 50% on
  Bamboo-7B). PowerInfer (arXiv 2312.12456) s3.1: 26% of OPT-30B's neurons carry 80% of one block's activations.
- LLM in a Flash (arXiv 2312.11514) s3.1, OPT-6.7B: the last 5 tokens' active neurons are 24% of the FFN and hold
  ~76% of the next token's.
- Qwen3-30B-A3B routing: expert reuse at t+1 45%, lag-1 overlap of a token's expert set 38% (engine route traces);
  a working-set router [fit] gives LRU hits 53 / 82 / 95% at 10 / 25 / 50% of the experts cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from dataclasses import dataclass, field

import numpy as np

CARRY_SHARES = (0.5, 0.8, 0.95)
CACHE_FRACTIONS = (0.10, 0.25, 0.50)
POLICIES = ("static-hot", "LRU", "hot+LRU")
UNION_TOKENS = 5


@dataclass(frozen=True)
class Anchors:
    """Published (or [fit]) values to print beside a model's; None where no anchor exists."""
    name: str
    carry: dict[float, float]                       # share of activations -> fraction of units carrying it
    lag1_overlap: float | None
    union5: float | None                            # the last 5 tokens' union as a fraction of the units
    union5_holds: float | None                      # share of the next token's units in that union
    hits: dict[str, dict[float, float]] = field(default_factory=dict)  # policy -> cache fraction -> hit rate
    source: str = ""
    phi: float | None = None                        # lag-1 autocorrelation of a unit's on/off series


# dense FFN, TurboSparse-Mistral-7B-like: Beta(0.4, 3.6) propensities and a two-state Markov persistence of lag-1
# autocorrelation 0.4 [fit] (its lag-1 overlap follows: E[p^2] (1 - 0.4) / E[p] + 0.4 = 0.57 at a mean of 0.10),
# the 5-token union from LLM in a Flash (OPT-6.7B)
DENSE_ANCHORS = Anchors("TurboSparse-Mistral-7B-like [fit]; union: LLM in a Flash",
                        {0.5: 0.127, 0.8: 0.30, 0.95: 0.52}, 0.57, 0.24, 0.76,
                        {"hot+LRU": {0.10: 0.52, 0.25: 0.79, 0.50: 0.94}},
                        "PowerInfer arXiv 2312.12456, PowerInfer-2 arXiv 2406.06282, LLM in a Flash arXiv 2312.11514",
                        0.4)
# MoE routing, Qwen3-30B-A3B-like: reuse at t+1 45% and lag-1 overlap 38% as measured by engines' route traces; the
# LRU and static-hot curves of a working-set router fitted to them [fit]
MOE_ANCHORS = Anchors("Qwen3-30B-A3B-like (route traces; LRU and static-hot [fit])", {}, 0.38, None, None,
                      {"LRU": {0.10: 0.53, 0.25: 0.82, 0.50: 0.95}, "static-hot": {0.10: 0.20, 0.25: 0.44, 0.50: 0.74}},
                      "Qwen3-30B-A3B engine route traces; BigMoeOnEdge route-trace findings")


@dataclass(frozen=True)
class ActivationStats:
    """One layer's (or a model's mean) statistics over a text; see the module's docstring."""
    n_units: int
    n_tokens: int
    density: float                                  # mean fraction of units active a token
    carry: dict[float, float]
    lag1_overlap: float
    union5: float
    union5_holds: float
    cold: dict[str, dict[float, float]]             # policy -> cache fraction -> hit rate from empty caches
    steady: dict[str, dict[float, float]]           # the same after the warm-up tokens
    phi: float = 0.0                                # pooled lag-1 autocorrelation of the units' on/off series


def carry_fractions(counts: np.ndarray, shares: Sequence[float] = CARRY_SHARES) -> dict[float, float]:
    """The fraction of units, hottest first, whose activation counts reach each share of the total."""
    c = np.sort(np.asarray(counts, np.float64))[::-1]
    total = c.sum()
    if total <= 0:
        return {s: 0.0 for s in shares}
    cum = np.cumsum(c) / total
    return {s: float((np.searchsorted(cum, s - 1e-12) + 1) / c.size) for s in shares}


def _pairs(n_tokens: int, window: int, lag: int) -> np.ndarray:
    """Token indices t (t >= lag) whose token t - lag is in the same window of consecutive text."""
    t = np.arange(lag, n_tokens)
    return t[(t % window) >= lag]


def lag1_overlap(active: np.ndarray, window: int) -> float:
    """Of the units active on a token, the share active on the token before (pooled over tokens)."""
    t = _pairs(active.shape[0], window, 1)
    now = active[t]
    both = (now & active[t - 1]).sum()
    return float(both / max(now.sum(), 1))


def lag1_autocorrelation(active: np.ndarray, window: int) -> float:
    """The units' on/off series' lag-1 autocorrelation, pooled (sum of covariances over sum of variances): a
    two-state Markov unit with P(on | on before) = p + phi (1 - p) gives phi, whatever its p."""
    t = _pairs(active.shape[0], window, 1)
    now, before = active[t].astype(np.float64), active[t - 1].astype(np.float64)
    m_now, m_before = now.mean(axis=0), before.mean(axis=0)
    cov = ((now - m_now) * (before - m_before)).mean(axis=0)
    var = np.sqrt(now.var(axis=0) * before.var(axis=0))
    return float(cov.sum() / max(var.sum(), 1e-12))


def union_stats(active: np.ndarray, window: int, n: int = UNION_TOKENS) -> tuple[float, float]:
    """(mean size of the union of the last n tokens' active units as a fraction of the units, share of the next
    token's active units inside it, pooled)."""
    t = _pairs(active.shape[0], window, n)
    if t.size == 0:
        return 0.0, 0.0
    union = np.zeros((t.size, active.shape[1]), dtype=bool)
    for lag in range(1, n + 1):
        union |= active[t - lag]
    now = active[t]
    return float(union.mean()), float((now & union).sum() / max(now.sum(), 1))


def _cache_hits(active: np.ndarray, pinned: np.ndarray, lru_size: int, warmup: int) -> tuple[float, float]:
    """Hits of a cache of `pinned` units plus an LRU of lru_size units over the others (each token's units loaded
    together: after a token the LRU holds the lru_size most recently used units not pinned); (cold, steady)."""
    n_units = active.shape[1]
    last = np.full(n_units, -1, np.int64)
    last[pinned] = np.iinfo(np.int64).max  # pinned units never enter the LRU ranking
    order_key = np.arange(n_units)         # ties (units of one token): the lower index is kept, as any fixed order
    hits = np.zeros(active.shape[0])
    need = active.sum(axis=1).astype(np.float64)
    is_pinned = np.zeros(n_units, dtype=bool)
    is_pinned[pinned] = True
    for t in range(active.shape[0]):
        cached = is_pinned.copy()
        if lru_size > 0:
            lru_keys = np.where(is_pinned, -2, last)
            if lru_size < n_units:
                top = np.argpartition(-(lru_keys * (n_units + 1) - order_key), lru_size - 1)[:lru_size]
            else:
                top = np.arange(n_units)
            top = top[lru_keys[top] >= 0]
            cached[top] = True
        a = active[t]
        hits[t] = (a & cached).sum()
        last[a & ~is_pinned] = t
    cold = float(hits.sum() / max(need.sum(), 1))
    steady = float(hits[warmup:].sum() / max(need[warmup:].sum(), 1)) if warmup < active.shape[0] else cold
    return cold, steady


def cache_hit_rates(active: np.ndarray, hot_rank: np.ndarray, fractions: Sequence[float] = CACHE_FRACTIONS,
                    warmup: int | None = None) -> tuple[dict[str, dict[float, float]], dict[str, dict[float, float]]]:
    """(cold, steady) hit rates per policy and cache fraction over active [n_tokens, n_units]; hot_rank: the units,
    hottest first, as a profile of other text ranked them (the static set and hot+LRU's pinned half).
    warmup: tokens not counted in steady state (default: a quarter of them)."""
    n_tok, n_units = active.shape
    w = n_tok // 4 if warmup is None else warmup
    cold: dict[str, dict[float, float]] = {p: {} for p in POLICIES}
    steady: dict[str, dict[float, float]] = {p: {} for p in POLICIES}
    for f in fractions:
        size = max(1, int(round(f * n_units)))
        for policy, pinned_n, lru_n in (("static-hot", size, 0), ("LRU", 0, size),
                                        ("hot+LRU", size // 2, size - size // 2)):
            c, s = _cache_hits(active, np.asarray(hot_rank[:pinned_n], np.int64), lru_n, w)
            cold[policy][f] = c
            steady[policy][f] = s
    return cold, steady


def activation_stats(active: np.ndarray, hot_rank: np.ndarray | None = None, window: int | None = None,
                     warmup: int | None = None) -> ActivationStats:
    """Statistics of one layer's active units [n_tokens, n_units] (bool) over consecutive text in windows of
    `window` tokens (pairs across a window boundary are not consecutive and are left out; default: one window).
    hot_rank: the units hottest first from a profile of other text (default: this text's own counts, an oracle)."""
    a = np.asarray(active, dtype=bool)
    n_tok, n_units = a.shape
    win = n_tok if window is None else window
    counts = a.sum(axis=0)
    rank = np.argsort(-counts, kind="stable") if hot_rank is None else np.asarray(hot_rank)
    u, holds = union_stats(a, win)
    cold, steady = cache_hit_rates(a, rank, warmup=warmup)
    return ActivationStats(n_units, n_tok, float(a.mean()), carry_fractions(counts), lag1_overlap(a, win), u, holds,
                           cold, steady, lag1_autocorrelation(a, win))


def routed_active(routes: np.ndarray, n_expert: int) -> np.ndarray:
    """[n_tokens, n_expert] bool from each token's routed experts [n_tokens, k]."""
    a = np.zeros((routes.shape[0], n_expert), dtype=bool)
    np.put_along_axis(a, routes.astype(np.int64), True, axis=1)
    return a


def mean_stats(layers: Sequence[ActivationStats]) -> ActivationStats:
    """The layers' statistics averaged (each layer weighs the same)."""
    if not layers:
        raise ValueError("no layers")

    def avg(get: object) -> float:
        return float(np.mean([get(x) for x in layers]))  # type: ignore[operator]

    def avg_hits(which: str) -> dict[str, dict[float, float]]:
        first: dict[str, dict[float, float]] = getattr(layers[0], which)
        return {p: {f: float(np.mean([getattr(x, which)[p][f] for x in layers])) for f in fs} for p, fs in first.items()}

    return ActivationStats(layers[0].n_units, layers[0].n_tokens, avg(lambda x: x.density),
                           {s: avg(lambda x, s=s: x.carry[s]) for s in layers[0].carry},
                           avg(lambda x: x.lag1_overlap), avg(lambda x: x.union5), avg(lambda x: x.union5_holds),
                           avg_hits("cold"), avg_hits("steady"), avg(lambda x: x.phi))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_table(stats: ActivationStats, anchors: Anchors, unit: str = "neurons") -> str:
    """The model's statistics beside the anchors', one row a statistic."""
    rows = [("statistic", "this model", f"anchor ({anchors.name})")]
    for s, v in stats.carry.items():
        rows.append((f"{unit} carrying {s:.0%} of activations", _fmt(v), _fmt(anchors.carry.get(s))))
    rows.append((f"mean active {unit} a token", _fmt(stats.density), "-"))
    rows.append(("lag-1 overlap (share of a token's set active the token before)", _fmt(stats.lag1_overlap),
                 _fmt(anchors.lag1_overlap)))
    rows.append(("lag-1 autocorrelation of a unit's on/off series", f"{stats.phi:.2f}",
                 "-" if anchors.phi is None else f"{anchors.phi:.2f}"))
    rows.append((f"union of last 5 tokens, share of {unit}", _fmt(stats.union5), _fmt(anchors.union5)))
    rows.append(("share of next token's set inside that union", _fmt(stats.union5_holds), _fmt(anchors.union5_holds)))
    for p in POLICIES:
        for f in stats.cold[p]:
            a = anchors.hits.get(p, {}).get(f)
            rows.append((f"{p} hits, {f:.0%} of {unit} cached (cold / steady)",
                         f"{_fmt(stats.cold[p][f])} / {_fmt(stats.steady[p][f])}", _fmt(a)))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def markov_active(freq: np.ndarray, n_tokens: int, phi: float, rng: np.random.Generator) -> np.ndarray:
    """The [fit] generator's firing [n_tokens, n_units]: unit i a two-state Markov chain of stationary propensity
    freq[i] and lag-1 autocorrelation phi (P(on | on before) = p + phi (1 - p), P(on | off before) = p (1 - phi))."""
    p = np.asarray(freq, np.float64)
    a = np.zeros((n_tokens, p.size), dtype=bool)
    a[0] = rng.random(p.size) < p
    on, off = p + phi * (1.0 - p), p * (1.0 - phi)
    for t in range(1, n_tokens):
        a[t] = rng.random(p.size) < np.where(a[t - 1], on, off)
    return a


def markov_fit_stats(freq: np.ndarray, n_tokens: int, phi: float, seed: int = 0, window: int | None = None,
                     calib_tokens: int | None = None) -> ActivationStats:
    """What the [fit] generator gives for these propensities over as many tokens as a measurement had (counting
    noise included), its static hot set ranked on calib_tokens (default n_tokens) of another run: the value a
    model of these propensities should reach."""
    rng = np.random.default_rng(seed)
    calib = markov_active(freq, calib_tokens or n_tokens, phi, rng)
    rank = np.argsort(-calib.sum(axis=0), kind="stable")
    return activation_stats(markov_active(freq, n_tokens, phi, rng), rank, window)


# MoE routing [fit]: a per-layer session working set (our reading of the fitted generator, set to reproduce its
# figures at Qwen3-30B-A3B's 128 experts top-8: LRU 53 / 80 / 96% and a static hot set profiled on another session
# 22 / 40 / 67% at 10 / 25 / 50% of the experts cached, lag-1 overlap 0.42 in a middle layer). Per layer: a working
# set of `ws` of the experts drawn by a global Zipf(POP_ZIPF) popularity, Zipf(ZIPF) weights inside it by rank, each
# expert of the token before kept with probability `keep`, a pick from outside the set (uniform) with probability LEAK,
# each member replaced (by popularity) with probability DRIFT a token; the first layer nearly uniform and hardly
# reused, the last in between (Qwen3-30B-A3B's layer 0 routes to 107 of 128 experts in 128 tokens, lag-1 0.07).
WS_ZIPF, WS_POP_ZIPF, WS_LEAK, WS_DRIFT = 0.9, 1.0, 0.05, 0.0025
WS_LAYERS = {"first": (0.85, 0.02), "middle": (0.35, 0.20), "last": (0.50, 0.05)}  # position -> (working set, keep)
REUSE_LAGS = (1, 8)
# Qwen3-30B-A3B's LRU per layer at these fractions of the experts cached (kekzl/imp PR 1374): 37 / 74 / 89 / 96% hits
QWEN3_LRU_FRACTIONS = (6 / 128, 24 / 128, 48 / 128, 80 / 128)
QWEN3_LRU_HITS = (0.37, 0.74, 0.89, 0.96)


def layer_position(il: int, first: int, last: int) -> str:
    """"first", "middle" or "last": which working-set profile a routed layer takes."""
    return "first" if il == first else "last" if il == last else "middle"


def working_set_routes(n_expert: int, k: int, n_tokens: int, ws: float, keep: float, rng: np.random.Generator,
                       pop: np.ndarray, zipf: float = WS_ZIPF, leak: float = WS_LEAK,
                       drift: float = WS_DRIFT) -> np.ndarray:
    """The [fit] generator's routes [n_tokens, k] for one session (see WS_LAYERS); pop: the experts' global
    popularity (a static hot set profiled on another session finds it)."""
    m = min(n_expert, max(k, int(round(ws * n_expert))))
    q = pop / pop.sum()
    members = rng.choice(n_expert, size=m, replace=False, p=q)
    wts = (np.arange(m) + 1.0) ** -zipf
    wts /= wts.sum()
    out = np.zeros((n_tokens, k), np.int64)
    prev: list[int] = []
    for t in range(n_tokens):
        for j in np.flatnonzero(rng.random(m) < drift):
            outside = np.setdiff1d(np.arange(n_expert), members)
            if outside.size:
                members[j] = rng.choice(outside, p=q[outside] / q[outside].sum())
        sel = [e for e in prev if rng.random() < keep]
        while len(sel) < k:
            e = int(rng.integers(n_expert)) if rng.random() < leak else int(members[rng.choice(m, p=wts)])
            if e not in sel:
                sel.append(e)
        out[t] = sel
        prev = sel
    return out


def working_set_fit_stats(n_expert: int, k: int, n_tokens: int, position: str = "middle", seeds: int = 4,
                          calib_tokens: int | None = None) -> ActivationStats:
    """What the [fit] generator gives for a layer of n_expert experts top-k at `position` over as many tokens as a
    measurement had, its static hot set ranked on calib_tokens (default n_tokens) of another session of the same
    layer; the mean of `seeds` draws (each its own popularity)."""
    ws, keep = WS_LAYERS[position]
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng([seed, n_expert, k])
        pop = 1.0 / (rng.permutation(n_expert) + 1.0) ** WS_POP_ZIPF
        calib = routed_active(working_set_routes(n_expert, k, calib_tokens or n_tokens, ws, keep, rng, pop), n_expert)
        rank = np.argsort(-calib.sum(axis=0), kind="stable")
        out.append(activation_stats(routed_active(working_set_routes(n_expert, k, n_tokens, ws, keep, rng, pop),
                                                  n_expert), rank))
    return mean_stats(out)


def reuse_within(active: np.ndarray, window: int, lags: Sequence[int] = REUSE_LAGS) -> tuple[dict[int, float], float]:
    """({d: share of a token's active units active in one of the d tokens before}, median reuse distance in tokens:
    over a token's active units that were active before in its window, the median distance to the last time)."""
    a = np.asarray(active, dtype=bool)
    n_tok, n_units = a.shape
    last = np.full(n_units, -1, np.int64)
    dists: list[np.ndarray] = []
    within = {d: 0 for d in lags}
    counted = 0
    for t in range(n_tok):
        if t % window == 0:
            last[:] = -1
        on = np.flatnonzero(a[t])
        if t % window >= max(lags):  # a token with its whole look-back inside the window
            seen = last[on]
            d = np.where(seen >= 0, t - seen, np.iinfo(np.int64).max)
            counted += on.size
            for lag in lags:
                within[lag] += int((d <= lag).sum())
        seen = last[on]
        dists.append((t - seen)[seen >= 0])
        last[on] = t
    dd = np.concatenate(dists) if dists else np.zeros(0)
    return {d: within[d] / max(counted, 1) for d in lags}, float(np.median(dd)) if dd.size else 0.0


def lru_hits(active: np.ndarray, fractions: Sequence[float], window: int | None = None,
             warmup: int | None = None) -> dict[float, float]:
    """Steady-state LRU hit rates at these fractions of the units cached (as cache_hit_rates' LRU: each token's units
    loaded together, ties to the lower index; caches empty at each window's start, its first `warmup` tokens, default
    a quarter, not counted), all sizes in one pass: a unit hits a cache of c iff fewer than c units rank above it by
    recency."""
    a = np.asarray(active, dtype=bool)
    n_tok, n_units = a.shape
    win = n_tok if window is None else window
    w = win // 4 if warmup is None else warmup
    sizes = np.array([max(1, int(round(f * n_units))) for f in fractions])
    hits = np.zeros(sizes.size)
    need = 0
    last = np.full(n_units, -1, np.int64)
    idx = np.arange(n_units)
    for t in range(n_tok):
        if t % win == 0:
            last[:] = -1
        on = np.flatnonzero(a[t])
        if t % win >= w:
            need += on.size
            lt = last[on]
            ok = lt >= 0
            above = (last[None, :] > lt[:, None]).sum(axis=1) + ((last[None, :] == lt[:, None])
                                                                & (idx[None, :] < on[:, None])).sum(axis=1)
            hits += ((above[ok][:, None]) < sizes[None, :]).sum(axis=0)
        last[on] = t
    return {f: float(h / max(need, 1)) for f, h in zip(fractions, hits)}


def distinct_bigram_share(tokens: Sequence[int]) -> float:
    """The share of distinct bigrams in a token stream: a synthetic model's greedy decode must walk (>= 0.9 over 256
    tokens) rather than repeat one token, so that engines fed no text see varied firing and routing."""
    bigrams = list(zip(tokens[:-1], tokens[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


def greedy_tokens(model: str | Path, n: int = 256, prompt: bytes = b"The history of") -> list[int]:
    """n tokens of llama.cpp's greedy decode of the model (stock, no plugin)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=512, verbose=False)
    try:
        out: list[int] = []
        for tok in llm.generate(llm.tokenize(prompt, add_bos=True), temp=0.0, top_k=1):
            out.append(tok)
            if len(out) >= n:
                break
        return out
    finally:
        llm.close()
