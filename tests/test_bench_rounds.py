"""The benchmark driver (pi2_gguf.bench.rounds): configurations in turn, medians, per-round ratio ranges, and
a configuration that fails is not run again."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pi2_gguf.bench.rounds import Ratio, ratio, run_in_turn
from pi2_gguf.errors import Pi2Error


@dataclass
class Run:
    tps: float
    status: str = "ok"


def test_configurations_run_in_turn_and_a_failure_is_not_run_again() -> None:
    order: list[str] = []
    speeds = {"stock": iter([1.0, 3.0, 2.0]), "pi2": iter([4.0, 9.0, 5.0])}

    def make(name: str):
        def run() -> Run:
            order.append(name)
            if name == "broken":
                raise RuntimeError("exit 1")
            if name == "oom":
                return Run(0.0, "OOM-killed")
            return Run(next(speeds[name]))
        return run

    series = run_in_turn([(n, make(n)) for n in ("stock", "pi2", "broken", "oom")], rounds=3,
                         failure=lambda r: "" if r.status == "ok" else r.status, progress=False)
    assert order == ["stock", "pi2", "broken", "oom", "stock", "pi2", "stock", "pi2"]
    stock, pi2, broken, oom = series
    assert stock.ok and stock.values("tps") == [1.0, 3.0, 2.0] and stock.median("tps") == 2.0
    assert not broken.ok and broken.failure == "exit 1" and broken.results == []
    assert not oom.ok and oom.failure == "OOM-killed" and [r.status for r in oom.results] == ["OOM-killed"]
    r = ratio(pi2.values("tps"), stock.values("tps"))
    assert r == Ratio(2.5, 2.5, 4.0, 3) and str(r) == "2.50x (2.50-4.00x)"


def test_one_round_has_no_range_and_bad_input_is_refused() -> None:
    assert str(ratio([3.0], [2.0])) == "1.50x"
    assert ratio([3.0], [0.0]) is None and ratio([], [1.0]) is None
    with pytest.raises(Pi2Error, match="rounds must be at least 1"):
        run_in_turn([("a", lambda: Run(1.0))], rounds=0, progress=False)
