"""`pi2-gguf bench`: stock llama.cpp and pi2 under the same memory limit (cgroup v1, cold page cache), each
configuration in a fresh process, the configurations in turn for --rounds rounds (rounds.py). The rows
and the columns are described in cli.BENCH_HELP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from ..runtime.isolated import greedy_command, parse_results
from ..runtime.memory_budget import BudgetUse
from . import PROMPT, cgroup, heldout_text
from .peers import Peer, parse_output, peer_command, peer_files
from .rounds import Series, ratio, run_in_turn


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
    disk_busy_share: float = -1.0    # time the model's (pi2 under a budget: the sidecar's) disk had reads in flight
                                     # during decode / decode time; -1: not a block device
    cache_hit_rate: float = 0.0      # pi2: bundles found in the hot or cold segment / bundles needed
    expert_hit_rate: float = 0.0     # pi2, MoE: routed (token, expert) pairs that read nothing / pairs routed
    expert_guess_rate: float = 0.0   # pi2, MoE: routed experts (distinct a batch) read ahead on the router's guess
    moe: bool = False                # pi2 counted routed experts under the budget
    hot_mb: float = 0.0              # pi2: the neuron cache's hot segment (profiled hottest bundles, fixed)
    cold_mb: float = 0.0             # pi2: its cold segment (CLOCK-managed bundles read on misses)
    major_faults: int = 0
    peer: bool = False               # a peer engine's row (--peer): its rates are what it printed (peers.py)
    budget_use: str = ""             # pi2 under a budget: where the budget went (memory_budget.BudgetUse.line)
    tokens: list[int] = field(default_factory=list)  # the tokens decoded (greedy picks, or the text evaluated)
    rounds: list[Row] = field(default_factory=list)  # with --rounds: each round's row (this one: medians)


# the row every other is compared with: stock's best fair setting under a limit (it runs from mmap)
STOCK_BASE = "stock llama.cpp, mmap, repack off"


def _modes(mode: str | None | list[str | None]) -> list[str | None]:
    """bench's --mode, given once or repeated (None: the runner's default, predicted with a sidecar)."""
    if isinstance(mode, list):
        return list(mode) or [None]
    return [mode]


def _configs(model: Path, sidecars: list[Path], mode: str | None | list[str | None], limit: int, n: int,
             threads: int, ctx: int,
             skip_unlimited: bool, variants: list[dict[str, str]] | None = None,
             forced_text: str | None = None, peers: list[Peer] | None = None,
             stock_defaults: bool = True) -> list[tuple[Row, list[str], int | None]]:
    command = partial(greedy_command, model, [PROMPT], n, threads=threads, ctx=ctx, logits=False,
                      forced_text=forced_text)
    rows: list[tuple[Row, list[str], int | None]] = []
    if stock_defaults:
        rows.append((Row("stock llama.cpp, defaults (mmap, repack)", True), command(pi2=False), limit))
    rows.append((Row(STOCK_BASE, True), command(pi2=False, repack=False), limit))
    modes = _modes(mode)
    for sc in sidecars:
        name = f" ({sc.name})" if len(sidecars) > 1 else ""
        for m in modes:
            # with more than one mode each row names its own (mode dense under a budget reads every neuron: what a
            # whole-layer read costs, beside the sparse reads the neuron layout allows)
            in_mode = f", mode {m or 'predicted'}" if len(modes) > 1 else ""
            for settings in [{}, *(variants or [])]:
                with_ = "".join(f", {k}={v}" for k, v in settings.items())
                rows.append((Row(f"pi2{name}, memory budget {limit / 1e6:.0f} MB{in_mode}{with_}", True),
                             command(pi2=True, sidecar=sc, mode=m, memory_budget=limit, settings=settings), limit))
    for peer in peers or []:  # a peer cannot be fed text: it decodes its own greedy picks
        rows.append((Row(f"{peer.name} (peer{', greedy' if forced_text is not None else ''})", True, peer=True),
                     peer_command(peer, str(model), PROMPT, n, threads), limit))
    if not skip_unlimited:
        rows.append((Row("pi2, all in RAM (no limit)", False),
                     command(pi2=True, sidecar=sidecars[0], mode=modes[0]), None))
    return rows


def measure(row: Row, cmd: list[str], mem: int | None, files: list[Path], read_bps: int | None, timeout: float) -> Row:
    """A copy of row filled from one run of cmd in fresh cgroups (limit mem, the files' page cache dropped first)."""
    row = replace(row, rounds=[])
    r = cgroup.run(cmd, mem, files, read_bps=read_bps, timeout=timeout)
    row.peak_mb = r.peak_bytes / 1e6
    row.disk_read_mb = r.disk_read_bytes / 1e6
    row.major_faults = r.major_faults
    if r.timed_out:
        row.status = f"timed out ({timeout:.0f} s)"
    elif r.oom_kills > 0:
        row.status = "OOM-killed"
    else:
        record(row, r.returncode, r.stdout, r.stderr)
    return row


def record(row: Row, returncode: int, stdout: str, stderr: str) -> Row:
    """Fills row from a finished run's exit code and output: its status, rates, bytes read a token and, for pi2, its
    cache, experts and where its budget went; the peak from the run's own peak RSS where no cgroup measured one."""
    if returncode != 0:
        last = (stderr.strip().splitlines() or ["?"])[-1]
        row.status = f"failed: {last[:120]}"
    elif row.peer:
        got = parse_output(stdout + "\n" + stderr)
        if got is None:
            row.status = "failed: printed no tok/s"
        else:
            row.prompt_tps, row.decode_tps, row.decoded = got.prompt_tps, got.decode_tps, got.decoded
            row.read_per_token_mb = got.read_per_token_mb or 0.0
            if got.expert_hit_rate is not None:
                row.moe, row.expert_hit_rate = True, got.expert_hit_rate
    else:
        g = parse_results(stdout)[0]
        row.prompt_tps, row.decode_tps, row.decoded, row.tokens = g.prompt_tps, g.decode_tps, len(g.tokens), g.tokens
        row.peak_mb = row.peak_mb or g.io.get("peak_rss", 0) / 1e6
        steps = max(len(g.tokens) - 1, 1)  # the last sampled token is not evaluated
        row.read_per_token_mb = g.io.get("process_read_bytes", 0) / steps / 1e6
        if g.decode_seconds > 0:
            row.io_wait_share = g.io.get("io_wait_s", 0.0) / g.decode_seconds
            if "disk_busy_s" in g.io:
                row.disk_busy_share = min(g.io["disk_busy_s"] / g.decode_seconds, 1.0)
        needed = g.io.get("hot_hits", 0) + g.io.get("cold_hits", 0) + g.io.get("misses", 0)
        if needed:
            row.cache_hit_rate = 1.0 - g.io["misses"] / needed
        pairs = g.io.get("expert_hits", 0) + g.io.get("expert_misses", 0)
        if pairs:
            row.moe, row.expert_hit_rate = True, g.io["expert_hits"] / pairs
            loaded = g.io.get("experts_loaded", 0)
            row.expert_guess_rate = g.io.get("experts_guessed_routed", 0) / loaded if loaded else 0.0
        # the cold column is the recency-replaced cache: the neuron cache's cold segment and any expert cache
        # (PI2_EXPERT_READS=model: routed experts read whole from the model file, least recently used replaced)
        row.hot_mb = g.io.get("hot_bytes", 0) / 1e6
        row.cold_mb = (g.io.get("cold_bytes", 0) + g.io.get("expert_bytes", 0)) / 1e6
        if "budget_use" in g.io:
            row.budget_use = BudgetUse.from_json(g.io["budget_use"]).line()
    return row


def _summary_row(template: Row, series: Series[Row]) -> Row:
    """One row for a configuration's rounds: medians of the rates, the highest peak; a failure if a round failed."""
    rows = series.results
    if not rows:
        return replace(template, status=f"failed: {series.failure[:120]}")
    failed = rows[-1] if series.failure else None
    out = replace(failed or rows[0], rounds=list(rows) if len(rows) > 1 else [])
    if failed is None:
        for name in ("prompt_tps", "decode_tps", "disk_read_mb", "read_per_token_mb", "io_wait_share", "disk_busy_share",
                     "cache_hit_rate", "expert_hit_rate", "expert_guess_rate", "hot_mb", "cold_mb"):
            setattr(out, name, series.median(name))
    out.peak_mb = max(r.peak_mb for r in rows)
    return out


def run_bench(model: Path, sidecars: Path | list[Path], limit: int, read_bps: int | None, n: int = 32,
              threads: int = 2, ctx: int = 512, mode: str | None | list[str | None] = None,
              timeout: float = 1200, skip_unlimited: bool = False, progress: bool = True, rounds: int = 1,
              variants: list[dict[str, str]] | None = None, decode: str = "greedy",
              peers: list[Peer] | None = None, stock_defaults: bool = True) -> list[Row]:
    """Every configuration `rounds` times in turn (bench/rounds.py); one summary row each. variants: per-model
    settings (e.g. {"output_rows": "64"}), each one more pi2 row per sidecar under the limit. mode: one decode mode,
    or a list of them for one pi2 row per mode under the limit (the in-RAM row takes the first). decode "text": every
    configuration's decode steps evaluate held-out corpus text (teacher forcing) instead of the model's picks (a
    peer's cannot: it decodes greedily). peers: one row each, under the same limit (peers.py). stock_defaults False:
    no row of stock's defaults (bench_runs)."""
    sidecars = [sidecars] if isinstance(sidecars, Path) else list(sidecars)
    forced = heldout_text(n) if decode == "text" else None
    runs = bench_runs(model, sidecars, limit, read_bps, n, threads, ctx, mode, timeout, skip_unlimited, variants,
                      forced, peers, stock_defaults)
    series = run_in_turn([(row.name, run) for row, run in runs], rounds, failure=row_failure, progress=progress)
    return summarize([row for row, _ in runs], series)


def bench_runs(model: Path, sidecars: list[Path], limit: int, read_bps: int | None, n: int, threads: int, ctx: int,
               mode: str | None | list[str | None], timeout: float, skip_unlimited: bool = False,
               variants: list[dict[str, str]] | None = None, forced_text: str | None = None,
               peers: list[Peer] | None = None, stock_defaults: bool = True) -> list[tuple[Row, Callable[[], Row]]]:
    """The configurations under one limit, each (its row's template, a run measuring it once), for run_in_turn;
    stock_defaults False: no row of stock's defaults (repack), which under a limit below the model is OOM-killed."""
    # the page cache is dropped for each before every configuration: the model, its sidecars and the files peers'
    # commands name (a peer's own model file and expert bundle), so every row starts cold
    files = [model] + sidecars + [f for peer in peers or [] for f in peer_files(peer)]
    configs = _configs(model, sidecars, mode, limit, n, threads, ctx, skip_unlimited, variants, forced_text, peers,
                       stock_defaults)
    return [(row, partial(measure, row, cmd, mem, files, read_bps, timeout)) for row, cmd, mem in configs]


def row_failure(row: Row) -> str:
    """run_in_turn's failure test: a configuration whose run did not end "ok" is not run again."""
    return "" if row.status == "ok" else row.status


def summarize(templates: list[Row], series: list[Series[Row]]) -> list[Row]:
    """One summary row per configuration (_summary_row), from run_in_turn's series of bench_runs' runs."""
    return [_summary_row(row, s) for row, s in zip(templates, series, strict=True)]


def decode_ratio(r: Row, base: Row | None) -> str:
    """decode vs the base row: the ratio of medians, and with rounds the range of the per-round ratios."""
    if r.status != "ok" or base is None or base.status != "ok":
        return "-"
    got = ratio([x.decode_tps for x in r.rounds or [r]], [x.decode_tps for x in base.rounds or [base]])
    return "-" if got is None else str(got)


def format_table(model: Path, limit: int, read_bps: int | None, rows: list[Row], decode: str = "greedy") -> str:
    base = next((r for r in rows if r.name.startswith(STOCK_BASE) and r.status == "ok"), None)
    pi2_ram = next((r for r in rows if not r.limited and r.status == "ok"), None)
    n_rounds = max((len(r.rounds) for r in rows), default=0)
    moe = any(r.moe for r in rows)  # routed experts: their hit rate too
    lines = [f"{model.name} ({model.stat().st_size / 1e9:.2f} GB), memory limit {limit / 1e6:.0f} MB, "
             f"read cap {f'{read_bps / 1e6:.0f} MB/s' if read_bps else 'none'}, cold page cache"
             + (f", {n_rounds} rounds in turn (medians; per-round ratio range)" if n_rounds > 1 else "")
             + (", decode evaluates held-out text (teacher forcing)" if decode == "text" else ""),
             "| configuration | status | prompt tok/s | decode tok/s | peak MB | disk read MB | read/token MB | I/O wait "
             "| disk busy | cache hot + cold MB | cache hits" + (" | expert hits | experts guessed" if moe else "") +
             " | decode vs stock (repack off) | decode vs pi2 in RAM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if moe else "")]
    for r in rows:
        ok = r.status == "ok"
        wait = f"{r.io_wait_share:.0%}" if ok and r.cache_hit_rate else "-"
        hits = f"{r.cache_hit_rate:.1%}" if ok and r.cache_hit_rate else "-"
        busy = f"{r.disk_busy_share:.0%}" if ok and r.disk_busy_share >= 0 else "-"
        cache = f"{r.hot_mb:.0f} + {r.cold_mb:.0f}" if ok and (r.hot_mb or r.cold_mb) else "-"
        experts = ((f" | {r.expert_hit_rate:.1%} | {r.expert_guess_rate:.1%}" if ok and r.moe else " | - | -")
                   if moe else "")
        lines.append(f"| {r.name} | {r.status} | {r.prompt_tps:.2f} | {r.decode_tps:.2f} | {r.peak_mb:.0f} | "
                     f"{r.disk_read_mb:.0f} | {r.read_per_token_mb:.1f} | {wait} | {busy} | {cache} | {hits}{experts} | "
                     f"{decode_ratio(r, base)} | {decode_ratio(r, pi2_ram)} |")
    for r in rows:  # the memory outside the cache, item by item (as the first round measured it)
        if r.status == "ok" and r.budget_use:
            lines.append(f"\n{r.name}: {r.budget_use}")
    return "\n".join(lines)
