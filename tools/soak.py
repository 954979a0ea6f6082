#!/usr/bin/env python3
"""Soak: long greedy generations from two models in one process, each loaded under a memory budget, inside a
cgroup v1 memory limit with a cold page cache.

    .venv/bin/python tools/soak.py [--model smollm2-135m --budget 200MB --model gemma3-270m --budget 480MB]
                                   [--cgroup-limit 540MB] [--tokens 1000] [--rounds 3] [--threads 2]
                                   [--out build/soak]

Budgets are process-wide (pi2_gguf.Llama's memory_budget bounds the whole process): the first model loads
under its budget, the second under its own, which counts the first model too, and the cgroup limit is the
larger. A thread samples the process's resident memory (VmRSS) every 100 ms. Each round generates --tokens
tokens from each model in turn (no stop at end of text) and records, per 100-token window, tok/s, bundle
reads per token and the cache's hit rate. The tokens of every round are compared with an in-RAM sparse run of
the same model (the same engine: see SAME_ENGINE). Prints a table, and writes soak.json and
soak.png (RSS against the budgets, tok/s, read per token, hits over time) to --out.
Exit 1 when a round's tokens differ or a sample exceeds the budget in force."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire"
WINDOW = 100
# Both runs use every layer's predictor (PI2_PREDICTOR=always): whether one pays is judged on RAM bytes in RAM and
# on flash bytes under a budget, and a layer without its predictor selects other neurons. The in-RAM run also
# keeps prompts and many-active tokens in the sparse engine, as a budget does (tests/test_memory_budget.py).
BOTH = {"predictor": "always"}
SAME_ENGINE = {**BOTH, "sparse_batch": 64, "down_sparse_max": 1.0}


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _generate(llm, n: int, windows: list[dict] | None, label: str, rnd: int) -> list[int]:
    """n greedy tokens after PROMPT (no stop at end of text), with per-window counters when windows is given."""
    import numpy as np

    import pi2_gguf
    from pi2_gguf.runtime.generate import last_logits

    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    tokens: list[int] = []
    t0 = time.perf_counter()
    pi2_gguf.reset_counters()
    for i in range(n):
        tok = int(np.argmax(last_logits(llm)))
        tokens.append(tok)
        llm.eval([tok])
        if windows is not None and ((i + 1) % WINDOW == 0 or i + 1 == n):
            c = pi2_gguf.read_counters()
            t1 = time.perf_counter()
            k = (i % WINDOW) + 1
            hits = int(c.hot_hits.sum() + c.cold_hits.sum())
            looked = hits + int(c.misses.sum())
            windows.append({"model": label, "round": rnd, "end_token": i + 1, "time": t1, "tok_s": k / (t1 - t0),
                            "read_per_token": int(c.bytes_read.sum()) / k, "hit_rate": hits / looked if looked else 1.0})
            t0 = t1
            pi2_gguf.reset_counters()
    return tokens


def worker(args: argparse.Namespace) -> int:
    """In the limited process (or in RAM with --ram): load every model, generate, print JSON."""
    import pi2_gguf
    from pi2_gguf.errors import Pi2Error

    try:
        return _work(args)
    except Pi2Error as e:  # a budget too small, a sidecar refused: one line for the parent to show
        print(f"soak worker: {e}", file=sys.stderr)
        return 2


def _work(args: argparse.Namespace) -> int:
    import pi2_gguf

    specs = json.loads(args.worker)
    out: dict = {"samples": [], "windows": [], "tokens": {}, "load_start": [], "loaded_at": []}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            out["samples"].append((time.perf_counter(), _vm("VmRSS")))
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    llms = []
    for s in specs:
        kw = {"settings": SAME_ENGINE} if args.ram else {"memory_budget": s["budget"], "settings": BOTH}
        out["load_start"].append(time.perf_counter())
        llms.append(pi2_gguf.Llama(s["model"], sidecar=s["sidecar"], n_ctx=args.tokens + 64, n_threads=args.threads,
                                   n_threads_batch=args.threads, verbose=False, **kw))
        out["loaded_at"].append(time.perf_counter())
    for rnd in range(1 if args.ram else args.rounds):
        for s, llm in zip(specs, llms):
            toks = _generate(llm, args.tokens, None if args.ram else out["windows"], s["label"], rnd)
            out["tokens"].setdefault(s["label"], []).append(toks)
    stop.set()
    sampler.join()
    out["peak_rss"] = _vm("VmHWM")
    out["cache"] = [vars(llm.cache_info()) if llm.cache_info() else None for llm in llms]
    for llm in llms:
        llm.close()
    print("SOAK-JSON " + json.dumps(out))
    return 0


HEADROOM = 64_000_000


def default_cgroup_limit(specs: list[dict]) -> int:
    """The largest budget plus HEADROOM: the cgroup also charges the page cache of what the models read
    through it (token embedding rows, file headers). With the limit at the budget, the 2026-11-25 soak kept
    VmRSS under the budget but decoded at 0.9 tok/s; 60 MB above it ran at full speed."""
    return max(s["budget_bytes"] for s in specs) + HEADROOM


def _run_worker(specs: list[dict], args: argparse.Namespace, ram: bool) -> dict:
    from pi2_gguf.bench import cgroup

    cmd = [sys.executable, __file__, "--worker", json.dumps(specs), "--tokens", str(args.tokens),
           "--rounds", str(args.rounds), "--threads", str(args.threads)] + (["--ram"] if ram else [])
    if ram:
        r = subprocess.run(cmd, capture_output=True, text=True)
        rc, stdout, stderr, extra = r.returncode, r.stdout, r.stderr, {}
    else:
        limit = args.cgroup_limit or default_cgroup_limit(specs)
        files = [Path(s[k]) for s in specs for k in ("model", "sidecar")]
        run = cgroup.run(cmd, limit, files, cold=True, timeout=args.timeout)
        rc, stdout, stderr = run.returncode, run.stdout, run.stderr
        extra = {"cgroup_limit": limit, "cgroup_peak": run.peak_bytes, "oom_kills": run.oom_kills,
                 "disk_read_bytes": run.disk_read_bytes, "wall_seconds": run.wall_seconds}
    line = next((x for x in stdout.splitlines() if x.startswith("SOAK-JSON ")), None)
    if rc != 0 or line is None:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
        sys.exit(f"soak: the {'in-RAM' if ram else 'limited'} run failed (exit {rc}): {last}")
    return {**json.loads(line[len("SOAK-JSON "):]), **extra}


def _plot(res: dict, specs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = res["samples"][0][0]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax[0].plot([t - t0 for t, _ in res["samples"]], [v / 1e6 for _, v in res["samples"]], lw=0.8, label="VmRSS")
    for s, t in zip(specs, res["loaded_at"]):
        ax[0].axhline(s["budget_bytes"] / 1e6, ls="--", lw=0.8, color="gray")
        ax[0].text(0, s["budget_bytes"] / 1e6, f" budget after {s['label']} loaded", va="bottom", fontsize=8)
        ax[0].axvline(t - t0, ls=":", lw=0.8, color="gray")
    ax[0].set_ylabel("MB")
    ax[0].legend(loc="lower right")
    for s in specs:
        w = [x for x in res["windows"] if x["model"] == s["label"]]
        ts = [x["time"] - t0 for x in w]
        ax[1].plot(ts, [x["tok_s"] for x in w], ".", label=s["label"])
        ax[2].plot(ts, [x["read_per_token"] / 1e6 for x in w], ".", label=s["label"])
        ax[3].plot(ts, [100 * x["hit_rate"] for x in w], ".", label=s["label"])
    for a, y in zip(ax[1:], ("decode tok/s (100-token windows)", "MB read per token", "cache hits %")):
        a.set_ylabel(y)
        a.legend(loc="lower right")
    ax[3].set_xlabel("seconds since the process started sampling")
    fig.suptitle("pi2-gguf soak: two models in one process, each under its budget, cgroup limit, cold cache")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="GGUF file or known model name (twice)")
    ap.add_argument("--sidecar", action="append", help="its sidecar (default: converted into --out once)")
    ap.add_argument("--budget", action="append", help="budget in force once this model is loaded (process-wide)")
    ap.add_argument("--cgroup-limit", help="memory limit of the cgroup (default: the largest budget + 64 MB, "
                    "room for the page cache of the files the models read; docs/MEASUREMENTS.md, soak)")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="compute threads per model")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "soak")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ram", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    from pi2_gguf.cli import resolve_model
    from pi2_gguf.converter.convert import convert
    from pi2_gguf.runtime.memory_budget import parse_size

    names = args.model or ["smollm2-135m", "gemma3-270m"]
    budgets = args.budget or ["200MB", "480MB"]
    sidecars = args.sidecar or [None] * len(names)
    if not (len(names) == len(budgets) == len(sidecars)):
        ap.error("give --model, --budget (and --sidecar) the same number of times")
    if args.tokens < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--tokens, --rounds and --threads must be at least 1")
    args.cgroup_limit = parse_size(args.cgroup_limit) if args.cgroup_limit else None
    args.out.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, budget, sidecar in zip(names, budgets, sidecars):
        model = resolve_model(name)
        if sidecar is None:
            sidecar = args.out / (model.stem + ".pi2.gguf")
            if not sidecar.is_file():
                print(f"converting {model.name} -> {sidecar}", flush=True)
                convert(model, sidecar)
        specs.append({"label": model.stem, "model": str(model), "sidecar": str(sidecar), "budget": budget,
                      "budget_bytes": parse_size(budget)})

    print("in-RAM sparse reference ...", flush=True)
    ram = _run_worker(specs, args, ram=True)
    print(f"soak: {args.rounds} rounds x {args.tokens} tokens per model, cgroup limit "
          f"{(args.cgroup_limit or default_cgroup_limit(specs)) / 1e6:.0f} MB, cold cache ...", flush=True)
    res = _run_worker(specs, args, ram=False)

    ok = True
    # a model's budget is in force from the start of its load to the start of the next model's
    starts = [float("-inf")] + res["load_start"][1:] + [float("inf")]
    rows = []
    for k, s in enumerate(specs):
        during = [v for t, v in res["samples"] if starts[k] <= t < starts[k + 1]]
        peak = max(during) if during else 0
        w = [x for x in res["windows"] if x["model"] == s["label"]]
        same = [toks == ram["tokens"][s["label"]][0] for toks in res["tokens"][s["label"]]]
        ok &= all(same) and peak <= s["budget_bytes"]
        first = [x for x in w if x["round"] == 0]
        last = [x for x in w if x["round"] == args.rounds - 1]
        rows.append((s["label"], s["budget"], peak / 1e6, sum(same), len(same),
                     sum(x["tok_s"] for x in first) / len(first), sum(x["tok_s"] for x in last) / len(last),
                     sum(x["read_per_token"] for x in w) / len(w) / 1e6, 100 * sum(x["hit_rate"] for x in w) / len(w)))
    print()
    print("| model | budget | peak VmRSS while in force (MB) | rounds equal to in-RAM | tok/s round 1 | tok/s last "
          "round | MB read/token | cache hits % |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]}/{r[4]} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.2f} | {r[8]:.1f} |")
    print(f"\nprocess: peak VmHWM {res['peak_rss'] / 1e6:.1f} MB, cgroup peak (RSS + page cache) "
          f"{res['cgroup_peak'] / 1e6:.1f} MB of {res['cgroup_limit'] / 1e6:.0f} MB, OOM kills {res['oom_kills']}, "
          f"{len(res['samples'])} RSS samples, {res['wall_seconds']:.0f} s, disk read {res['disk_read_bytes'] / 1e6:.0f} MB")
    (args.out / "soak.json").write_text(json.dumps({"specs": specs, "result": res, "ram_tokens": ram["tokens"]}))
    _plot(res, specs, args.out / "soak.png")
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    print("PASS" if ok else "FAIL: tokens differ from the in-RAM run or RSS went above a budget")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
