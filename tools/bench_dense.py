#!/usr/bin/env python3
"""Dense-path benchmark: stock llama.cpp vs pi2 (FFN in the PI2 plugin, dense), same run.

Each configuration decodes in its own fresh process; rounds run the configurations in turn so that load
on this shared machine hits them alike (pi2_gguf.bench.rounds). Prints medians and the ratio to stock
(of the medians, with the range of the per-round ratios).

    .venv/bin/python tools/bench_dense.py [MODEL] [--rounds 3] [-n 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from pi2_gguf.assets import models
from pi2_gguf.bench import PROMPT
from pi2_gguf.bench.rounds import markdown_table, run_in_turn
from pi2_gguf.runtime.generate import Greedy
from pi2_gguf.runtime.isolated import greedy_in_subprocess

STOCK = "stock llama.cpp (repack on, default)"


def decode_once(model: Path, n: int, threads: int, **config: object) -> Greedy:
    return greedy_in_subprocess(model, [PROMPT], n, threads=threads, ctx=1024, logits=False, **config)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b", help="GGUF path or known model name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    path = models.fetch(args.model) if args.model in models.MODELS else Path(args.model)
    configs = {
        STOCK: dict(pi2=False, repack=True),
        "stock llama.cpp (repack off)": dict(pi2=False, repack=False),
        "pi2 dense": dict(pi2=True, repack=True),
    }
    series = run_in_turn([(name, partial(decode_once, path, args.n, args.threads, **cfg))
                          for name, cfg in configs.items()], args.rounds, desc="runs")
    print(f"\n{path.name}, {args.threads} threads, {args.n} decoded tokens, median of {args.rounds} rounds")
    print(markdown_table(series, series[0],
                         {"prompt tok/s": ("prompt_tps", ".1f"), "decode tok/s": ("decode_tps", ".2f")},
                         {"prompt vs stock": "prompt_tps", "decode vs stock": "decode_tps"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
