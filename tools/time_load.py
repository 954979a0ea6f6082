#!/usr/bin/env python3
"""Load-time benchmark: how long `pi2_gguf.Llama(...)` takes to construct, with each sidecar given, under a memory
budget and in RAM, each load in its own fresh process (page cache as the previous run left it: warm after the
first round), the configurations in turn for --rounds rounds. Prints the median seconds and the ratio to the first.

    .venv/bin/python tools/time_load.py MODEL SIDECAR [SIDECAR ...] [--memory-budget 1035MB] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pi2_gguf.bench.rounds import markdown_table, run_in_turn

# constructs the model in a fresh interpreter and prints the seconds it took as JSON
_CHILD = """
import json, sys, time
import pi2_gguf
model, sidecar, budget = sys.argv[1], sys.argv[2], sys.argv[3] or None
t0 = time.monotonic()
llm = pi2_gguf.Llama(model, sidecar=sidecar, memory_budget=budget, n_ctx=512, n_threads=2, verbose=False)
seconds = time.monotonic() - t0
llm.close()
print(json.dumps({"seconds": seconds}))
"""


@dataclass
class Load:
    seconds: float


def load_once(model: Path, sidecar: Path, budget: str | None) -> Load:
    res = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(sidecar), budget or ""], capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"loading {model} with {sidecar} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return Load(float(json.loads(res.stdout.strip().splitlines()[-1])["seconds"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("sidecars", type=Path, nargs="+")
    ap.add_argument("--memory-budget", default="1035MB", help="the budget of the budgeted loads (e.g. 1035MB)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    configs = [(f"{sc.name}, budget {args.memory_budget}", partial(load_once, args.model, sc, args.memory_budget))
               for sc in args.sidecars]
    configs += [(f"{sc.name}, in RAM", partial(load_once, args.model, sc, None)) for sc in args.sidecars[:1]]
    series = run_in_turn(configs, args.rounds, desc="loads")
    print(f"\n{args.model.name}: seconds to construct pi2_gguf.Llama, median of {args.rounds} rounds")
    print(markdown_table(series, series[0], {"load s": ("seconds", ".2f")}, {"vs first": "seconds"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
