#!/usr/bin/env python3
"""Sparse-decode benchmark, all in RAM: stock llama.cpp vs pi2 dense vs pi2 sparse (one row per sidecar),
for one or more models in the same run.

Each configuration decodes in its own fresh process; rounds run the configurations in turn so that load
on this shared machine hits them alike (pi2_gguf.bench.rounds). Prints medians and ratios to stock
llama.cpp (default settings, which repack Q4_K weights for faster GEMM/GEMV): of the medians, with the
range of the per-round ratios.

    .venv/bin/python tools/bench_sparse.py --case MODEL.gguf S50.pi2.gguf,S90.pi2.gguf [--case ...]
        [--rounds 3] [-n 64] [--threads 2] [--mode predicted] [--all-layers]

pi2 rows run with the default placement (PI2_LAYERS=auto: layers PI2 would not decode faster are left to
ggml-cpu, docs/BACKEND.md); --all-layers adds each with every layer held, to measure PI2's own kernels.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pi2_gguf.bench import PROMPT, heldout_text  # noqa: E402
from pi2_gguf.bench.rounds import markdown_table, run_in_turn  # noqa: E402
from pi2_gguf.runtime.generate import Greedy  # noqa: E402
from pi2_gguf.runtime.isolated import greedy_in_subprocess  # noqa: E402


def sidecar_label(path: Path) -> str:
    r = GGUFReader(path, "r")
    method = r.get_field("pi2.sparsity.method").contents()
    target = float(r.get_field("pi2.sparsity.target").contents())
    ranks = sorted({int(v) for v in r.get_field("pi2.predictor.rank").contents()})
    rank = f", rank {ranks[0]}" if len(ranks) == 1 else f", ranks {ranks[0]}-{ranks[-1]}"
    if method == "relu":
        what = "relu (exact)"
    elif target < 0:  # a fixed threshold, not a target
        what = f"{method}, threshold {float(r.get_field('pi2.sparsity.thresholds').contents()[0]):g}"
    else:
        what = f"{target:.0%} {method}"
    return what + rank


def decode_once(model: Path, n: int, threads: int, **config: object) -> Greedy:
    return greedy_in_subprocess(model, [PROMPT], n, threads=threads, ctx=1024, logits=False, **config)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=2, action="append", required=True, metavar=("MODEL", "SIDECARS"),
                    help="a model and its sidecars (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="predicted", choices=("predicted", "oracle"))
    ap.add_argument("--decode", choices=("greedy", "text"), default="greedy",
                    help="text: decode steps evaluate held-out corpus text (teacher forcing) instead of the tokens picked")
    ap.add_argument("--all-layers", action="store_true",
                    help="also each pi2 row with PI2_LAYERS=all (PI2 holds every FFN layer: its own kernels)")
    args = ap.parse_args()
    forced = heldout_text(args.n) if args.decode == "text" else None

    for model_s, sidecars_s in args.case:
        model = Path(model_s)
        configs: dict[str, dict] = {
            "stock llama.cpp (default, repack on)": dict(pi2=False, repack=True),
            "stock llama.cpp (repack off)": dict(pi2=False, repack=False),
            "pi2 dense": dict(pi2=True),
        }
        if args.all_layers:
            configs["pi2 dense, all layers held"] = dict(pi2=True, settings={"layers": "all"})
        for s in filter(None, sidecars_s.split(",")):
            sc = Path(s)
            configs[f"pi2 {args.mode}, {sidecar_label(sc)}"] = dict(pi2=True, sidecar=sc, mode=args.mode)
            if args.all_layers:
                configs[f"pi2 {args.mode}, {sidecar_label(sc)}, all layers held"] = dict(
                    pi2=True, sidecar=sc, mode=args.mode, settings={"layers": "all"})
        series = run_in_turn([(name, partial(decode_once, model, args.n, args.threads, forced_text=forced, **cfg))
                              for name, cfg in configs.items()], args.rounds, desc=model.name)
        print(f"\n{model.name} ({model.stat().st_size / 1e9:.2f} GB), {args.threads} threads, {args.n} decoded tokens, "
              f"median of {args.rounds} rounds" + (", decode evaluates held-out text" if forced else ""))
        print(markdown_table(series, series[0], {"active": ("active_fraction", ".1%"),
                                                 "prompt tok/s": ("prompt_tps", ".1f"),
                                                 "decode tok/s": ("decode_tps", ".2f")},
                             {"prompt vs stock": "prompt_tps", "decode vs stock": "decode_tps"}))
        held = [f"{s.name}: {s.results[0].layers_in_pi2}" for s in series if s.ok and s.results[0].layers_in_pi2]
        print("\nFFN layers PI2 computed (the rest were left to ggml-cpu): " + "; ".join(held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
