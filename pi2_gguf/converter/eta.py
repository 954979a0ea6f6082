"""The whole convert's progress: the steps it knows it will still run, what each kind of unit (a profiled token, a
planned layer, a written layer, a scored token) has cost so far, and from those the time left. convert prints a
status line as each step begins and puts the time left on the per-step bars it draws."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

# Before a kind of unit has been timed, its cost is guessed from one that has (seconds a unit):
# - a planned layer ~ LAYER_PER_TRAIN_TOKEN profiled tokens per training token (SmolLM2-135M, 4,096 training
#   tokens: 0.6-0.8 s a layer at 4.1 ms a profiled token, 0.04-0.05; the 1.5B models ~8 s a layer at ~8 ms, ~0.12);
# - a dense perplexity token ~ a profiled token (both are llama.cpp prompt windows of 256 tokens: SmolLM2 4.5 ms
#   against 4.1), a sparse one under a memory budget SPARSE_PER_DENSE of them (SmolLM2: 5.9 s a chunk against 1.2);
# - a written layer WRITE_PER_LAYER of a planned one.
LAYER_PER_TRAIN_TOKEN = 0.08
SPARSE_PER_DENSE = 5.0
WRITE_PER_LAYER = 0.1


@dataclass
class _Step:
    kind: str
    units: float
    done: float = 0.0


def clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Steps are named (e.g. "layers 0.40"), each of a kind whose units take about the same time. expect() adds or
    resizes a step, begin() starts it (and prints a status line), advance() counts units done (timed: computed now;
    untimed: reused from the work directory, which says nothing about speed), drop() forgets a step not run."""

    def __init__(self, enabled: bool, train_tokens: int, write: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self.train_tokens = train_tokens
        self.t0 = time.monotonic()
        self.steps: dict[str, _Step] = {}
        self.cost: dict[str, tuple[float, float]] = {}  # kind -> (seconds, units) timed
        self._mark = self.t0
        self._write = write or (lambda s: tqdm.write(s, file=sys.stderr))

    def expect(self, step: str, kind: str, units: float) -> None:
        old = self.steps.get(step)
        self.steps[step] = _Step(kind, units, old.done if old else 0.0)

    def drop(self, step: str) -> None:
        self.steps.pop(step, None)

    def begin(self, step: str, label: str | None) -> None:
        """Starts timing step; prints the status line of label (None: none yet, say() prints it later)."""
        self._mark = time.monotonic()
        if label is not None:
            self.say(label)

    def say(self, label: str) -> None:
        if self.enabled:
            self._write(f"[convert {clock(time.monotonic() - self.t0)}, {self.left_text()}] {label}")

    def advance(self, step: str, units: float = 1.0, timed: bool = True) -> None:
        now = time.monotonic()
        s = self.steps.get(step)
        if s is not None:
            s.done = min(s.units, s.done + units)
            if timed:
                spent, n = self.cost.get(s.kind, (0.0, 0.0))
                self.cost[s.kind] = (spent + now - self._mark, n + units)
        self._mark = now

    def seed(self, kind: str, seconds: object, units: float) -> None:
        """Counts work an earlier convert timed (a piece reused from the work directory records what it took), so a
        resumed convert estimates from the start."""
        if isinstance(seconds, (int, float)) and seconds >= 0 and units > 0:
            spent, n = self.cost.get(kind, (0.0, 0.0))
            self.cost[kind] = (spent + float(seconds), n + units)

    def end(self, step: str) -> None:
        s = self.steps.get(step)
        if s is not None:
            s.done = s.units

    def rate(self, kind: str) -> float | None:
        """Seconds a unit of kind: measured, else guessed from a measured kind, else None."""
        spent, n = self.cost.get(kind, (0.0, 0.0))
        if n > 0:
            return spent / n
        tok = self.rate("profile") if kind != "profile" else None
        if kind == "profile":
            dense = self.cost.get("ppl_dense", (0.0, 0.0))
            return dense[0] / dense[1] if dense[1] else None
        if tok is None:
            if kind == "write" and self.cost.get("layer", (0, 0))[1]:
                layer = self.rate("layer")
                return None if layer is None else WRITE_PER_LAYER * layer
            return None
        return {"layer": LAYER_PER_TRAIN_TOKEN * tok * self.train_tokens, "ppl_dense": tok,
                "ppl_sparse": SPARSE_PER_DENSE * tok,
                "write": WRITE_PER_LAYER * LAYER_PER_TRAIN_TOKEN * tok * self.train_tokens}.get(kind)

    def left(self) -> tuple[float, bool]:
        """(seconds left for the steps known, whether every one of them could be estimated)."""
        total, known = 0.0, True
        for s in self.steps.values():
            todo = s.units - s.done
            if todo <= 0:
                continue
            r = self.rate(s.kind)
            if r is None:
                known = False
            else:
                total += r * todo
        return total, known

    def left_text(self) -> str:
        seconds, known = self.left()
        if known:
            return f"about {clock(seconds)} left"
        # a step not yet timed nor guessable (after a resume that reused the profile, until a layer is planned)
        return f"at least {clock(seconds)} left" if seconds >= 1 else "time left: estimating"

    def postfix(self) -> str:
        """The time left and spent, for a step's own bar."""
        return f"convert {clock(time.monotonic() - self.t0)}, {self.left_text()}"
