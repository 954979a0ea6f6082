"""Configurations measured in turn: each round runs every configuration once (stock, pi2, stock, pi2, ...),
so a disk or a neighbour that slows down for a while slows all of them alike. Results are summarized by
their medians, and one configuration against another by the ratio of the medians and the range of the
per-round ratios. A configuration that fails is not run again. Used by `pi2-gguf bench`,
tools/bench_dense.py and tools/bench_sparse.py."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tqdm import tqdm

from ..errors import Pi2Error

R = TypeVar("R")


@dataclass
class Series(Generic[R]):
    """One configuration's results, one per round it ran; `failure` says why it stopped (its last result,
    if the run returned one, is the failed one)."""

    name: str
    results: list[R] = field(default_factory=list)
    failure: str = ""

    @property
    def ok(self) -> bool:
        return not self.failure and bool(self.results)

    def values(self, attr: str) -> list[float]:
        return [float(getattr(r, attr)) for r in self.results]

    def median(self, attr: str) -> float:
        return statistics.median(self.values(attr))


def run_in_turn(configs: Sequence[tuple[str, Callable[[], R]]], rounds: int,
                failure: Callable[[R], str] | None = None, desc: str = "bench",
                progress: bool = True) -> list[Series[R]]:
    """Runs every configuration once per round, in turn, `rounds` times. A run that raises Pi2Error or
    RuntimeError, or whose result `failure` describes (a non-empty string), ends its configuration."""
    if rounds < 1:
        raise Pi2Error(f"rounds must be at least 1, got {rounds}")
    series: list[Series[R]] = [Series(name) for name, _ in configs]
    with tqdm(total=rounds * len(configs), desc=desc, unit="run", disable=not progress) as bar:
        for _ in range(rounds):
            for s, (_, run) in zip(series, configs, strict=True):
                if not s.failure:
                    try:
                        result = run()
                    except (Pi2Error, RuntimeError) as e:
                        s.failure = str(e) or type(e).__name__
                    else:
                        s.results.append(result)
                        s.failure = failure(result) if failure else ""
                bar.update()
    return series


@dataclass(frozen=True)
class Ratio:
    """a against b: the ratio of their medians and the range of the per-round ratios."""

    median: float
    low: float
    high: float
    rounds: int

    def __str__(self) -> str:
        text = f"{self.median:.2f}x"
        return text + (f" ({self.low:.2f}-{self.high:.2f}x)" if self.rounds > 1 else "")


def ratio(a: Sequence[float], b: Sequence[float]) -> Ratio | None:
    """median(a) / median(b), with the range of a[i] / b[i] over the rounds both ran; None without values
    or with a zero median of b."""
    if not a or not b or statistics.median(b) == 0:
        return None
    per = [x / y for x, y in zip(a, b) if y]  # zip: rounds both ran
    med = statistics.median(a) / statistics.median(b)
    return Ratio(med, min(per, default=med), max(per, default=med), len(per))


def markdown_table(series: Sequence[Series[R]], base: Series[R] | None, medians: dict[str, tuple[str, str]],
                   ratios: dict[str, str]) -> str:
    """One row per configuration: medians (header -> (attribute, format spec)), then the ratio to `base` of
    the attributes in `ratios` (header -> attribute); a failed configuration shows why."""
    head = ["configuration", *medians, *ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in series:
        if not s.ok:
            cells = [f"failed: {s.failure[-120:]}"] + ["-"] * (len(head) - 2)
        else:
            cells = [format(s.median(attr), spec) for attr, spec in medians.values()]
            for attr in ratios.values():
                got = ratio(s.values(attr), base.values(attr)) if base is not None and base.ok else None
                cells.append("-" if got is None else str(got))
        lines.append("| " + " | ".join([s.name, *cells]) + " |")
    return "\n".join(lines)
