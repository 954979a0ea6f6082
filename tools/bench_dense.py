#!/usr/bin/env python3
"""Dense-path benchmark: stock llama.cpp vs pi2 (FFN in the PI2 plugin, dense), same run.

Each configuration decodes in its own fresh process; rounds alternate the configurations so that
load on this shared machine hits them alike. Prints medians and the ratio to stock.

    .venv/bin/python tools/bench_dense.py [MODEL] [--rounds 3] [-n 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from pi2_gguf.assets import models
from pi2_gguf.runtime.isolated import greedy_in_subprocess

PROMPT = ("Write a Python function that parses a CSV file of sales records and returns the total "
          "revenue per region, then explain how it handles malformed lines.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b", help="GGUF path or known model name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    path = models.fetch(args.model) if args.model in models.MODELS else Path(args.model)
    configs = {
        "stock llama.cpp (repack on, default)": dict(pi2=False, repack=True),
        "stock llama.cpp (repack off)": dict(pi2=False, repack=False),
        "pi2 dense": dict(pi2=True, repack=True),
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    with tqdm(total=args.rounds * len(configs), desc="runs") as bar:
        for _ in range(args.rounds):
            for name, cfg in configs.items():
                g = greedy_in_subprocess(path, [PROMPT], args.n, threads=args.threads, ctx=1024, logits=False, **cfg)[0]
                results[name].append((g.prompt_tps, g.decode_tps))
                bar.update()

    base_p = statistics.median(r[0] for r in results["stock llama.cpp (repack on, default)"])
    base_d = statistics.median(r[1] for r in results["stock llama.cpp (repack on, default)"])
    print(f"\n{path.name}, {args.threads} threads, {args.n} decoded tokens, median of {args.rounds} rounds")
    print(f"| {'configuration':38s} | prompt tok/s | decode tok/s | prompt vs stock | decode vs stock |")
    print(f"|{'-' * 40}|--------------|--------------|-----------------|-----------------|")
    for name, rs in results.items():
        p = statistics.median(r[0] for r in rs)
        d = statistics.median(r[1] for r in rs)
        print(f"| {name:38s} | {p:12.1f} | {d:12.2f} | {p / base_p:14.2f}x | {d / base_d:14.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
