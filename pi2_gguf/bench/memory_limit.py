"""pi2-gguf bench: stock llama.cpp and pi2 under the same memory limit, in one run.

Each configuration decodes in a fresh process inside its own cgroup v1 memory (and blkio) group, with a
cold page cache (pi2_gguf.cgroup). Rows:
  - stock llama.cpp, defaults: mmap and CPU weight repacking (the repacked copy is anonymous memory, so
    under a limit below the model size it is usually OOM-killed)
  - stock llama.cpp, repack off: runs from mmap (llama-bench --repack 0), stock's best fair setting here
  - pi2 with memory_budget = the limit: the FFN on flash behind the neuron cache (one row per --sidecar:
    sidecars of one model side by side, e.g. converted with --bundle-align 4096 and 512)
  - pi2 all in RAM with the first sidecar, no limit (the reference for "how much of its in-RAM speed does
    pi2 keep")
Prints tokens/s (prompt, decode), peak cgroup memory, bytes read per decoded token, the I/O wait share of
decode time, and ratios.

    pi2-gguf bench MODEL.gguf --memory-limit 600MB [--read-bps 1GB] [--rounds 3] [--json]

With --rounds N the configurations run in turn N times (stock, pi2, stock, pi2, ...), so that a disk
or a neighbour that slows down for a while slows both; the table gives medians and, per configuration,
the spread of its per-round ratio to stock (a configuration that fails in a round is not run again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from ..errors import Pi2Error
from ..runtime.isolated import greedy_command, parse_results
from ..runtime.memory_budget import parse_size
from . import cgroup

PROMPT = ("Write a Python function that parses a CSV file of sales records and returns the total "
          "revenue per region, then explain how it handles malformed lines.")


@dataclass
class Row:
    name: str
    limited: bool
    status: str = "ok"               # ok | OOM-killed | timed out | failed: ...
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    decoded: int = 0
    peak_mb: float = 0.0
    disk_read_mb: float = 0.0        # the whole run, load included (blkio)
    read_per_token_mb: float = 0.0   # during decode (/proc/self/io of the process)
    io_wait_share: float = 0.0       # pi2: time decode threads waited for bundles / decode time
    cache_hit_rate: float = 0.0      # pi2: bundles found in the hot or cold segment / bundles needed
    major_faults: int = 0
    rounds: list[Row] = field(default_factory=list)  # with --rounds: each round's row (this one: medians)


def _configs(model: Path, sidecars: list[Path], mode: str | None, limit: int, n: int, threads: int, ctx: int,
             skip_unlimited: bool) -> list[tuple[Row, list[str], int | None]]:
    common = dict(prompts=[PROMPT], n=n, threads=threads, ctx=ctx, logits=False)
    rows = [
        (Row("stock llama.cpp, defaults (mmap, repack)", True), greedy_command(model, pi2=False, **common), limit),
        (Row("stock llama.cpp, mmap, repack off", True), greedy_command(model, pi2=False, repack=False, **common), limit),
    ]
    for sc in sidecars:
        name = f" ({sc.name})" if len(sidecars) > 1 else ""
        rows.append((Row(f"pi2{name}, memory budget {limit / 1e6:.0f} MB", True),
                     greedy_command(model, pi2=True, sidecar=sc, mode=mode, memory_budget=limit, **common), limit))
    if not skip_unlimited:
        rows.append((Row("pi2, all in RAM (no limit)", False),
                     greedy_command(model, pi2=True, sidecar=sidecars[0], mode=mode, **common), None))
    return rows


def _measure(row: Row, cmd: list[str], mem: int | None, files: list[Path], read_bps: int | None, timeout: float) -> Row:
    row = replace(row, rounds=[])
    r = cgroup.run(cmd, mem, files, read_bps=read_bps, timeout=timeout)
    row.peak_mb = r.peak_bytes / 1e6
    row.disk_read_mb = r.disk_read_bytes / 1e6
    row.major_faults = r.major_faults
    if r.timed_out:
        row.status = f"timed out ({timeout:.0f} s)"
    elif r.oom_kills > 0:
        row.status = "OOM-killed"
    elif r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        row.status = f"failed: {last[:120]}"
    else:
        g = parse_results(r.stdout)[0]
        row.prompt_tps, row.decode_tps, row.decoded = g.prompt_tps, g.decode_tps, len(g.tokens)
        steps = max(len(g.tokens) - 1, 1)  # the last sampled token is not evaluated
        row.read_per_token_mb = g.io.get("process_read_bytes", 0) / steps / 1e6
        if g.decode_seconds > 0:
            row.io_wait_share = g.io.get("io_wait_s", 0.0) / g.decode_seconds
        needed = g.io.get("hot_hits", 0) + g.io.get("cold_hits", 0) + g.io.get("misses", 0)
        if needed:
            row.cache_hit_rate = 1.0 - g.io["misses"] / needed
    return row


def _median_row(rows: list[Row]) -> Row:
    """One row for a configuration's rounds: medians of the rates, the highest peak; a failure if any round failed."""
    failed = next((r for r in rows if r.status != "ok"), None)
    out = replace(failed or rows[0], rounds=list(rows) if len(rows) > 1 else [])
    if failed is None:
        for name in ("prompt_tps", "decode_tps", "disk_read_mb", "read_per_token_mb", "io_wait_share", "cache_hit_rate"):
            setattr(out, name, statistics.median(getattr(r, name) for r in rows))
    out.peak_mb = max(r.peak_mb for r in rows)
    return out


def run_bench(model: Path, sidecars: Path | list[Path], limit: int, read_bps: int | None, n: int = 32,
              threads: int = 2, ctx: int = 512, mode: str | None = None, timeout: float = 1200,
              skip_unlimited: bool = False, progress: bool = True, rounds: int = 1) -> list[Row]:
    sidecars = [sidecars] if isinstance(sidecars, Path) else list(sidecars)
    files = [model] + sidecars  # the page cache is dropped for each before every configuration
    configs = _configs(model, sidecars, mode, limit, n, threads, ctx, skip_unlimited)
    done: list[list[Row]] = [[] for _ in configs]
    with tqdm(total=rounds * len(configs), desc="bench", unit="run", disable=not progress) as bar:
        for _ in range(rounds):
            for k, (row, cmd, mem) in enumerate(configs):
                if not done[k] or done[k][-1].status == "ok":  # a configuration that failed is not run again
                    done[k].append(_measure(row, cmd, mem, files, read_bps, timeout))
                bar.update()
    return [_median_row(rows) for rows in done]


def _ratio(r: Row, base: Row | None) -> str:
    """decode vs the stock row: the ratio of medians, and with rounds the range of the per-round ratios."""
    if r.status != "ok" or base is None or base.status != "ok" or not base.decode_tps:
        return "-"
    text = f"{r.decode_tps / base.decode_tps:.2f}x"
    if r.rounds and len(r.rounds) == len(base.rounds):
        per = [a.decode_tps / b.decode_tps for a, b in zip(r.rounds, base.rounds) if b.decode_tps]
        text += f" ({min(per):.2f}-{max(per):.2f}x)"
    return text


def format_table(model: Path, limit: int, read_bps: int | None, rows: list[Row]) -> str:
    base = next((r for r in rows if r.name.startswith("stock llama.cpp, mmap, repack off") and r.status == "ok"), None)
    pi2_ram = next((r for r in rows if not r.limited and r.status == "ok"), None)
    n_rounds = max((len(r.rounds) for r in rows), default=0)
    lines = [f"{model.name} ({model.stat().st_size / 1e9:.2f} GB), memory limit {limit / 1e6:.0f} MB, "
             f"read cap {f'{read_bps / 1e6:.0f} MB/s' if read_bps else 'none'}, cold page cache"
             + (f", {n_rounds} rounds in turn (medians; per-round ratio range)" if n_rounds > 1 else ""),
             "| configuration | status | prompt tok/s | decode tok/s | peak MB | disk read MB | read/token MB | I/O wait "
             "| cache hits | decode vs stock (repack off) | decode vs pi2 in RAM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.status == "ok"
        wait = f"{r.io_wait_share:.0%}" if ok and r.cache_hit_rate else "-"
        hits = f"{r.cache_hit_rate:.1%}" if ok and r.cache_hit_rate else "-"
        lines.append(f"| {r.name} | {r.status} | {r.prompt_tps:.2f} | {r.decode_tps:.2f} | {r.peak_mb:.0f} | "
                     f"{r.disk_read_mb:.0f} | {r.read_per_token_mb:.1f} | {wait} | {hits} | {_ratio(r, base)} | "
                     f"{_ratio(r, pi2_ram)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pi2-gguf bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("model", type=Path)
    ap.add_argument("--memory-limit", required=True, help="cgroup memory limit and pi2's budget, e.g. 600MB")
    ap.add_argument("--read-bps", help="cap disk reads, e.g. 1GB (per second; UFS 4.0 random 4 KiB reads ~1GB)")
    ap.add_argument("--sidecar", type=Path, action="append",
                    help="default: MODEL.pi2.gguf beside the model; repeat for one pi2 row per sidecar")
    ap.add_argument("--mode", choices=("oracle", "predicted"), help="pi2 decode mode (default predicted)")
    ap.add_argument("-n", type=int, default=32, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations in turn this many times; report medians and ratio ranges")
    ap.add_argument("--skip-unlimited", action="store_true", help="no in-RAM pi2 row")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    from ..gguf_file import check_model_file
    from ..sidecar.format import sidecar_path_for

    model = check_model_file(args.model)
    sidecars = args.sidecar or [sidecar_path_for(model)]
    for sidecar in sidecars:
        if not sidecar.is_file():
            raise Pi2Error(f"sidecar {sidecar}: not found; run `pi2-gguf convert {model}` or pass --sidecar")
    if args.rounds < 1:
        raise Pi2Error(f"pi2-gguf bench: --rounds must be at least 1, got {args.rounds}")
    limit = parse_size(args.memory_limit)
    read_bps = parse_size(args.read_bps) if args.read_bps else None
    why = cgroup.available()
    if why:
        raise Pi2Error(f"pi2-gguf bench: {why}")
    rows = run_bench(model, sidecars, limit, read_bps, args.n, args.threads, args.ctx, args.mode, args.timeout,
                     args.skip_unlimited, progress=not args.json, rounds=args.rounds)
    if args.json:
        json.dump({"model": str(model), "memory_limit": limit, "read_bps": read_bps,
                   "rows": [asdict(r) for r in rows]}, sys.stdout, indent=1)
        print()
    else:
        print(format_table(model, limit, read_bps, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
