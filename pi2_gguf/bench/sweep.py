"""`pi2-gguf bench MODEL --sweep 25%,50%,100%`: stock llama.cpp (repack off) and pi2 (memory_budget = the limit) at
each of several memory limits in one run, and a summary of decode tok/s against the limit (plot.py draws it).

Each limit's two configurations are memory_limit.py's (cgroup v1 limit, cold page cache, a fresh process each),
and every configuration of every limit runs in turn (rounds.py): each round runs each limit's stock and pi2 once
(limit 1 stock, limit 1 pi2, limit 2 stock, ...), so a disk or a neighbour that slows down for a while slows all
of them alike. A configuration that fails (stock OOM-killed or timed out, pi2 refused a budget too small) keeps
its status and is not run again; the others go on."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import MemoryBudgetError, Pi2Error
from . import heldout_text
from .memory_limit import STOCK_BASE, Row, bench_runs, decode_ratio, row_failure, summarize
from .rounds import ratio, run_in_turn

EXAMPLE = "give percentages of the model file's size, e.g. 25%,50%,100%, or sizes, e.g. 300MB,600MB"


@dataclass(frozen=True)
class SweepEntry:
    """One entry of --sweep: a share of the model file's size (percent) or a size in bytes."""

    text: str                      # as given, e.g. "25%" or "300MB"
    percent: float | None = None   # of the model file's size
    size: int | None = None        # bytes

    def limit(self, model_size: int) -> int:
        """The memory limit in bytes for a model file of model_size bytes."""
        if self.percent is not None:
            return int(model_size * self.percent / 100)
        assert self.size is not None
        return self.size


def _entry(text: str) -> SweepEntry:
    from ..runtime.memory_budget import parse_size

    if text.endswith("%"):
        try:
            percent = float(text[:-1].strip())
        except ValueError:
            raise Pi2Error(f"--sweep entry '{text}' is not a percentage ({EXAMPLE})") from None
        if not (math.isfinite(percent) and percent > 0):
            raise Pi2Error(f"--sweep entry '{text}' is not a positive percentage ({EXAMPLE})")
        return SweepEntry(text, percent=percent)
    try:
        size = parse_size(text, "--sweep entry")
    except MemoryBudgetError:
        raise Pi2Error(f"--sweep entry '{text}' is not a positive size or percentage ({EXAMPLE})") from None
    return SweepEntry(text, size=size)


def parse_sweep(text: str) -> list[SweepEntry]:
    """--sweep's comma-separated entries: "N%" (of the model file's size) or a size ("300MB", "0.5GiB", a plain
    number of bytes, as --memory-limit reads it). Pi2Error naming the bad entry, or when there are none."""
    if not text.strip():
        raise Pi2Error(f"--sweep '{text}' lists no memory limits ({EXAMPLE})")
    entries = []
    for i, part in enumerate(text.split(","), 1):
        if not part.strip():
            raise Pi2Error(f"--sweep '{text}': entry {i} is empty ({EXAMPLE})")
        entries.append(_entry(part.strip()))
    return entries


def resolve_limits(entries: list[SweepEntry], model_size: int) -> list[tuple[SweepEntry, int]]:
    """Each entry with its limit in bytes for this model file, smallest limit first. Pi2Error when a share of the
    file comes to less than a byte or two entries come to the same limit."""
    seen: dict[int, SweepEntry] = {}
    for e in entries:
        limit = e.limit(model_size)
        if limit <= 0:
            raise Pi2Error(f"--sweep entry '{e.text}' is less than a byte of the {model_size}-byte model file")
        if limit in seen:
            raise Pi2Error(f"--sweep entries '{seen[limit].text}' and '{e.text}' are the same limit "
                           f"({limit / 1e6:.0f} MB, {limit} bytes)")
        seen[limit] = e
    return sorted(((e, limit) for limit, e in seen.items()), key=lambda x: x[1])


@dataclass
class SweepPoint:
    """One memory limit's rows: stock llama.cpp (repack off), then pi2 under the budget."""

    limit: int
    entry: str                 # the --sweep entry it came from ("25%", "300MB")
    rows: list[Row] = field(default_factory=list)

    @property
    def stock(self) -> Row:
        return next(r for r in self.rows if r.name.startswith(STOCK_BASE))

    @property
    def pi2(self) -> Row:
        return next(r for r in self.rows if r.name.startswith("pi2"))


def run_sweep(model: Path, sidecar: Path, limits: list[tuple[str, int]], read_bps: int | None, n: int = 32,
              threads: int = 2, ctx: int = 512, mode: str | None = None, timeout: float = 1200,
              progress: bool = True, rounds: int = 1, decode: str = "greedy") -> list[SweepPoint]:
    """limits: (the --sweep entry, bytes) each. Every limit's configurations, all of them in turn `rounds` times;
    one SweepPoint a limit, its rows the medians of the rounds (memory_limit.summarize)."""
    forced = heldout_text(n) if decode == "text" else None
    plans = [bench_runs(model, [sidecar], limit, read_bps, n, threads, ctx, mode, timeout, skip_unlimited=True,
                        forced_text=forced, stock_defaults=False) for _, limit in limits]
    runs = [(row.name, run) for plan in plans for row, run in plan]
    series = run_in_turn(runs, rounds, failure=row_failure, desc="sweep", progress=progress)
    points: list[SweepPoint] = []
    at = 0
    for (entry, limit), plan in zip(limits, plans, strict=True):
        rows = summarize([row for row, _ in plan], series[at:at + len(plan)])
        points.append(SweepPoint(limit, entry, rows))
        at += len(plan)
    return points


def cell(row: Row) -> str:
    """A summary cell: decode tok/s, or why there is none (the limit's table has the whole status)."""
    if row.status == "ok":
        return f"{row.decode_tps:.2f}"
    if "MemoryBudgetError" in row.status:  # pi2 refused the budget: its minimum is in the limit's table
        return "budget too small"
    return "failed" if row.status.startswith("failed") else row.status  # OOM-killed, timed out (N s)


def format_summary(model: Path, points: list[SweepPoint], predicted: dict[int, float] | None = None) -> str:
    """One row per limit: stock's and pi2's decode tok/s and pi2 against stock; with predicted ({limit: tok/s},
    `pi2-gguf plan`'s), the plan's tok/s and how far the measured pi2 is from it."""
    size = model.stat().st_size
    n_rounds = max((len(r.rounds) for p in points for r in p.rows), default=0)
    lines = [f"{model.name} ({size / 1e6:.0f} MB): decode tok/s against the memory limit, stock llama.cpp (mmap, "
             "repack off) and pi2 (memory budget = the limit)"
             + (f", {n_rounds} rounds in turn (medians; per-round ratio range)" if n_rounds > 1 else ""),
             "| memory limit | share of the model file | stock tok/s | pi2 tok/s | pi2 vs stock |"
             + (" plan tok/s | pi2 vs plan |" if predicted is not None else ""),
             "|---|---|---|---|---|" + ("---|---|" if predicted is not None else "")]
    for p in points:
        plan = ""
        if predicted is not None:
            want = predicted.get(p.limit, 0.0)
            off = f"{p.pi2.decode_tps / want - 1:+.0%}" if want > 0 and p.pi2.status == "ok" else "-"
            plan = f" {want:.2f} | {off} |" if want > 0 else " below its minimum | - |"
        lines.append(f"| {p.limit / 1e6:.0f} MB | {p.limit / size:.0%} | {cell(p.stock)} | {cell(p.pi2)} | "
                     f"{decode_ratio(p.pi2, p.stock)} |{plan}")
    return "\n".join(lines)


def series(points: list[SweepPoint]) -> dict[str, list[tuple[int, float]]]:
    """The plot's series: {"stock": [(limit bytes, decode tok/s)], "pi2": [...]}, the limits each ran at."""
    return {"stock": [(p.limit, p.stock.decode_tps) for p in points if p.stock.status == "ok"],
            "pi2": [(p.limit, p.pi2.decode_tps) for p in points if p.pi2.status == "ok"]}


def summary_json(points: list[SweepPoint], predicted: dict[int, float] | None = None) -> list[dict[str, object]]:
    """--json's "summary": one object per limit (with predicted, the plan's tok/s too)."""
    out: list[dict[str, object]] = []
    for p in points:
        both = p.stock.status == p.pi2.status == "ok"
        r = ratio([x.decode_tps for x in p.pi2.rounds or [p.pi2]], [x.decode_tps for x in p.stock.rounds or [p.stock]])
        out.append({"memory_limit": p.limit, "entry": p.entry,
                    "stock_status": p.stock.status,
                    "stock_decode_tps": p.stock.decode_tps if p.stock.status == "ok" else None,
                    "pi2_status": p.pi2.status,
                    "pi2_decode_tps": p.pi2.decode_tps if p.pi2.status == "ok" else None,
                    "pi2_vs_stock": asdict(r) if both and r is not None else None,
                    "plan_decode_tps": None if predicted is None else predicted.get(p.limit)})
    return out
