#!/usr/bin/env python3
"""Sparse-decode benchmark, all in RAM: stock llama.cpp vs pi2 dense vs pi2 sparse (one row per sidecar),
for one or more models in the same run.

Each configuration decodes in its own fresh process; rounds alternate the configurations so that load on
this shared machine hits them alike. Prints medians and ratios to stock llama.cpp (default settings,
which repack Q4_K weights for faster GEMM/GEMV).

    .venv/bin/python tools/bench_sparse.py --case MODEL.gguf S50.pi2.gguf,S90.pi2.gguf [--case ...]
        [--rounds 3] [-n 64] [--threads 2] [--mode predicted]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from gguf import GGUFReader
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pi2_gguf.runtime.isolated import greedy_in_subprocess  # noqa: E402

PROMPT = ("Write a Python function that parses a CSV file of sales records and returns the total "
          "revenue per region, then explain how it handles malformed lines.")


def sidecar_label(path: Path) -> str:
    r = GGUFReader(path, "r")
    method = r.get_field("pi2.sparsity.method").contents()
    target = float(r.get_field("pi2.sparsity.target").contents())
    ranks = sorted({int(v) for v in r.get_field("pi2.predictor.rank").contents()})
    rank = f", rank {ranks[0]}" if len(ranks) == 1 else f", ranks {ranks[0]}-{ranks[-1]}"
    return ("relu (exact)" if method == "relu" else f"{target:.0%} {method}") + rank


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=2, action="append", required=True, metavar=("MODEL", "SIDECARS"),
                    help="a model and its sidecars (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="predicted", choices=("predicted", "oracle"))
    args = ap.parse_args()

    for model_s, sidecars_s in args.case:
        model = Path(model_s)
        configs: dict[str, dict] = {
            "stock llama.cpp (default, repack on)": dict(pi2=False, repack=True),
            "stock llama.cpp (repack off)": dict(pi2=False, repack=False),
            "pi2 dense": dict(pi2=True),
        }
        for s in sidecars_s.split(","):
            sc = Path(s)
            configs[f"pi2 {args.mode}, {sidecar_label(sc)}"] = dict(pi2=True, sidecar=sc, mode=args.mode)
        results: dict[str, list] = {k: [] for k in configs}
        with tqdm(total=args.rounds * len(configs), desc=model.name) as bar:
            for _ in range(args.rounds):
                for name, cfg in configs.items():
                    g = greedy_in_subprocess(model, [PROMPT], args.n, threads=args.threads, ctx=1024, logits=False,
                                             **cfg)[0]
                    results[name].append(g)
                    bar.update()
        base = results["stock llama.cpp (default, repack on)"]
        base_p = statistics.median(g.prompt_tps for g in base)
        base_d = statistics.median(g.decode_tps for g in base)
        print(f"\n{model.name} ({model.stat().st_size / 1e9:.2f} GB), {args.threads} threads, {args.n} decoded tokens, "
              f"median of {args.rounds} rounds")
        print(f"| {'configuration':40s} | active | prompt tok/s | decode tok/s | prompt vs stock | decode vs stock |")
        print(f"|{'-' * 42}|--------|--------------|--------------|-----------------|-----------------|")
        for name, gs in results.items():
            p = statistics.median(g.prompt_tps for g in gs)
            d = statistics.median(g.decode_tps for g in gs)
            act = statistics.median(g.active_fraction for g in gs)
            act_s = f"{act:6.1%}" if act > 0 else "     -"
            print(f"| {name:40s} | {act_s} | {p:12.1f} | {d:12.2f} | {p / base_p:14.2f}x | {d / base_d:14.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
