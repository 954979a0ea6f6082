"""`pi2-gguf bench --sweep` (pi2_gguf.bench.sweep, .plot): the sweep's entries (good ones and each bad one refused
naming it), every limit's configurations in turn with a failure kept as its status, the summary table, the PNG,
and one sweep end to end under cgroup limits (root only)."""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

import pi2_gguf
from pi2_gguf.bench import cgroup, sweep
from pi2_gguf.bench.memory_limit import STOCK_BASE, Row
from pi2_gguf.bench.plot import log_y, save_sweep_png
from pi2_gguf.bench.sweep import SweepEntry, format_summary, parse_sweep, resolve_limits, run_sweep
from pi2_gguf.errors import MemoryBudgetError, Pi2Error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_good_sweeps_parse() -> None:
    assert parse_sweep("25%,50%,75%,100%") == [SweepEntry(f"{p}%", percent=float(p)) for p in (25, 50, 75, 100)]
    assert parse_sweep("300MB,0.5GiB") == [SweepEntry("300MB", size=300_000_000), SweepEntry("0.5GiB", size=2**29)]
    assert parse_sweep(" 12.5 % , 150") == [SweepEntry("12.5 %", percent=12.5), SweepEntry("150", size=150)]
    assert parse_sweep("150%") == [SweepEntry("150%", percent=150.0)]  # above the file: room for stock's KV cache


@pytest.mark.parametrize("text, message", [
    ("abc", "--sweep entry 'abc' is not a positive size or percentage"),
    ("25%,abc", "--sweep entry 'abc' is not"),
    ("0%", "--sweep entry '0%' is not a positive percentage"),
    ("-5%", "--sweep entry '-5%' is not a positive percentage"),
    ("nan%", "--sweep entry 'nan%' is not a positive percentage"),
    ("inf%", "--sweep entry 'inf%' is not a positive percentage"),
    ("%", "--sweep entry '%' is not a percentage"),
    ("50%%", "--sweep entry '50%%' is not a percentage"),
    ("0", "--sweep entry '0' is not a positive size"),
    ("-1MB", "--sweep entry '-1MB' is not a positive size"),
    ("12XB", "--sweep entry '12XB' is not"),
    ("", "--sweep '' lists no memory limits"),
    ("  ", "--sweep '  ' lists no memory limits"),
    (",", "--sweep ',': entry 1 is empty"),
    ("25%,,50%", "--sweep '25%,,50%': entry 2 is empty"),
])
def test_bad_sweeps_are_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(Pi2Error) as e:
        parse_sweep(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_limits_are_shares_of_the_model_file_smallest_first() -> None:
    got = resolve_limits(parse_sweep("100%,300MB,25%"), 1_000_000_000)
    assert [(e.text, b) for e, b in got] == [("25%", 250_000_000), ("300MB", 300_000_000), ("100%", 1_000_000_000)]
    with pytest.raises(Pi2Error, match="entries '50%' and '500MB' are the same limit"):
        resolve_limits(parse_sweep("50%,500MB"), 1_000_000_000)
    with pytest.raises(Pi2Error, match="entries '50%' and '50.0%' are the same limit"):
        resolve_limits(parse_sweep("50%,50.0%"), 1_000_000_000)
    with pytest.raises(Pi2Error, match="'0.001%' is less than a byte"):
        resolve_limits(parse_sweep("0.001%"), 1000)


def test_every_limit_runs_in_turn_and_a_failure_keeps_its_status(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Rounds, then limits, then configurations; stock OOM-killed and pi2 refused its budget at the small limit,
    and pi2 failing at the large one, are run once and keep their statuses; the summary has every limit."""
    order: list[str] = []
    speeds = {("stock", 2000): iter([2.0, 4.0]), ("pi2", 2000): iter([9.0, 11.0]), ("stock", 3000): iter([4.0, 6.0])}

    def measure(row: Row, limit: int) -> Row:
        engine = "stock" if row.name == STOCK_BASE else "pi2"
        order.append(f"{engine}@{limit}")
        if limit == 100:
            status = "OOM-killed" if engine == "stock" else \
                "failed: pi2_gguf.errors.MemoryBudgetError: memory budget 0 MB is too small for m.gguf"
            return Row(row.name, True, status=status)
        if (engine, limit) == ("pi2", 3000):
            raise RuntimeError("exit 1")
        return Row(row.name, True, decode_tps=next(speeds[engine, limit]))

    def runs(model: Path, sidecars: list[Path], limit: int, *args: object,
             **kwargs: object) -> list[tuple[Row, Callable[[], Row]]]:
        assert kwargs["stock_defaults"] is False and kwargs["skip_unlimited"] is True
        rows = [Row(STOCK_BASE, True), Row(f"pi2, memory budget {limit / 1e6:.0f} MB", True)]
        return [(r, partial(measure, r, limit)) for r in rows]

    monkeypatch.setattr(sweep, "bench_runs", runs)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1000)
    points = run_sweep(model, tmp_path / "m.pi2.gguf", [("10%", 100), ("200%", 2000), ("300%", 3000)], None,
                       rounds=2, progress=False)
    assert order == ["stock@100", "pi2@100", "stock@2000", "pi2@2000", "stock@3000", "pi2@3000",
                     "stock@2000", "pi2@2000", "stock@3000"]
    assert [p.limit for p in points] == [100, 2000, 3000] and [p.entry for p in points] == ["10%", "200%", "300%"]
    low, mid, high = points
    assert low.stock.status == "OOM-killed" and "MemoryBudgetError" in low.pi2.status
    assert mid.stock.decode_tps == 3.0 and mid.pi2.decode_tps == 10.0 and len(mid.pi2.rounds) == 2
    assert high.pi2.status == "failed: exit 1" and high.stock.decode_tps == 5.0
    table = format_summary(model, points)
    assert "| 0 MB | 10% | OOM-killed | budget too small | - |" in table
    assert "| 0 MB | 200% | 3.00 | 10.00 | 3.33x (2.75-4.50x) |" in table
    assert "| 0 MB | 300% | 5.00 | failed | - |" in table
    assert "2 rounds in turn" in table
    assert sweep.series(points) == {"stock": [(2000, 3.0), (3000, 5.0)], "pi2": [(2000, 10.0)]}
    summary = sweep.summary_json(points)
    assert summary[0]["stock_decode_tps"] is None and summary[0]["pi2_vs_stock"] is None
    assert summary[0]["stock_status"] == "OOM-killed"
    assert summary[1]["pi2_vs_stock"] == {"median": pytest.approx(10 / 3), "low": 2.75, "high": 4.5, "rounds": 2}


def _png_size_and_software(path: Path) -> tuple[int, int, str]:
    """(width, height, the Software text chunk) of a PNG, checking its magic and every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    at, software, size = 8, "", (0, 0)
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt" and body.startswith(b"Software\0"):
            software = body.split(b"\0", 1)[1].decode()
        at += 12 + length
        if kind == b"IEND":
            break
    assert at == len(data)
    return size[0], size[1], software


def test_the_plot_is_a_png_drawn_by_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    stock = [(300_000_000, 0.9), (150_000_000, 0.3), (600_000_000, 12.0)]
    pi2 = [(150_000_000, 4.0), (300_000_000, 6.5), (600_000_000, 14.0)]
    out = save_sweep_png(tmp_path / "sweep.png", "qwen.gguf", stock, pi2,
                         predicted=[(150_000_000, 3.5), (600_000_000, 15.0)])
    assert out == tmp_path / "sweep.png" and out.is_file() and not out.is_symlink()
    width, height, software = _png_size_and_software(out)
    assert (width, height) == (800, 500)  # 8 x 5 inches at 100 dpi
    assert software.startswith("Matplotlib")
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temp file left
    # nothing ran: still a valid PNG, and no predicted series is fine
    _png_size_and_software(save_sweep_png(tmp_path / "empty.png", "m.gguf", [], []))


def test_log_y_when_the_speeds_span_a_decade() -> None:
    assert log_y([0.3, 14.0]) and not log_y([4.0, 14.0]) and not log_y([]) and not log_y([0.0, 5.0])


def _minimum(model: Path, sidecar: Path) -> int:
    """The smallest budget the plugin accepts for this model (from its refusal of 1 MB)."""
    with pytest.raises(MemoryBudgetError) as e:
        pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="1MB", n_ctx=256, n_threads=2, verbose=False)
    m = re.search(r"needs (?:at least|more than) (\d+) MB", str(e.value))
    assert m, str(e.value)
    return int(m.group(1)) * 1_000_000


@pytest.mark.skipif(cgroup.available() is not None, reason=str(cgroup.available()))
def test_sweep_end_to_end(relu_model: tuple[Path, Path, list], capsys: pytest.CaptureFixture[str],
                          tmp_path: Path) -> None:
    """`pi2-gguf bench MODEL --sweep A,B --png FILE -n 4`: both limits' tables, the summary with both, the PNG."""
    pytest.importorskip("matplotlib")
    from pi2_gguf.cli import main

    model, sidecar, _ = relu_model
    low = _minimum(model, sidecar) + 40_000_000
    high = low + 40_000_000
    png = tmp_path / "sweep.png"
    assert main(["bench", str(model), "--sweep", f"{high},{low}", "--sidecar", str(sidecar), "-n", "4",
                 "--timeout", "120", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("decode tok/s against the memory limit"):]
    for limit in (low, high):
        assert f"memory limit {limit / 1e6:.0f} MB" in out  # the limit's own table
        assert f"\n| {limit / 1e6:.0f} MB | " in summary, summary
    assert summary.index(f"| {low / 1e6:.0f} MB |") < summary.index(f"| {high / 1e6:.0f} MB |")  # smallest first
    assert re.search(rf"^\| {high / 1e6:.0f} MB \| \d+% \| [^|]+ \| \d+\.\d\d \|", summary, re.M), summary  # pi2 ran
    assert f"plot: {png}" in out
    assert _png_size_and_software(png)[2].startswith("Matplotlib")
