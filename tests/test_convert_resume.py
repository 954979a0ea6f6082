"""convert resumes where an interrupted convert stopped (converter/resume.py, docs/CONVERT.md "Resume"): the pieces
it keeps in SIDECAR.partial/ are reused only where their keys still match, unusable ones are computed again, a
resumed convert writes the bytes an uninterrupted one writes, and the work directory is gone once the sidecar is."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pi2_gguf.sidecar import reader as sidecar
from pi2_gguf.converter import convert as convert_mod
from pi2_gguf.converter import resume

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "pi2_gguf.cli"]
EPOCH = "1700000000"
# the token budgets every convert here takes (the model's calibration text is short)
FAST = ["--train-tokens", "512", "--heldout-tokens", "128"]
FAST_KW = dict(train_tokens=512, heldout_tokens=128, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer SiLU model of 128 x 512 F32 FFNs with uniform statistics (tools/make_model.py, ~10 s)."""
    out = tmp_path_factory.mktemp("model") / "tiny.gguf"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(out), "--stats", "uniform",
                          "--n-embd", "128", "--n-ff", "512", "--n-layer", "8", "--n-head", "4", "--n-head-kv", "4",
                          "--activation", "silu", "--type", "F32", "--calib-tokens", "256", "--heldout-tokens", "128"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture
def epoch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Converts in this process record SOURCE_DATE_EPOCH's date, so two of them can write the same bytes."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    yield


def _env() -> dict[str, str]:
    return {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> object:
    """The next convert stops as Ctrl-C stops it once n layers are planned (KeyboardInterrupt in layer n + 1); returns
    the real fit_layer."""
    real = convert_mod.pred_mod.fit_layer
    calls = [0]

    def fit(*a, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(convert_mod.pred_mod, "fit_layer", fit)
    return real


def _interrupted(tiny: Path, out: Path, monkeypatch: pytest.MonkeyPatch, n: int = 3, **kw: object) -> Path:
    out.unlink(missing_ok=True)
    real = _interrupt_after(monkeypatch, n)
    with pytest.raises(KeyboardInterrupt):
        convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None, **kw})  # type: ignore[arg-type]
    monkeypatch.setattr(convert_mod.pred_mod, "fit_layer", real)
    work = resume.work_dir_for(out)
    names = [p.name for p in work.glob("*.npz")]
    assert sum(m.startswith("profile-") for m in names) == 1 and sum(m.startswith("layer-") for m in names) == n, names
    assert not out.exists()
    return work


def _resumed_note(res: convert_mod.ConvertResult) -> str:
    return next((n for n in res.notes if n.startswith("resumed from")), "")


def test_killed_convert_resumes_and_writes_the_same_bytes(tiny: Path, tmp_path: Path) -> None:
    """(a) kill -9 once the work directory holds the profile and two layers, rerun the same command: it says it
    resumes and writes the sidecar an uninterrupted convert writes, byte for byte; (d) no work directory is left."""
    ref = tmp_path / "ref.pi2.gguf"
    res = subprocess.run([*CLI, "convert", str(tiny), "-o", str(ref), *FAST], capture_output=True, text=True,
                         env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[convert " in res.stderr and " left] planning 8 layers at sparsity 0.50" in res.stderr  # a status line
    assert not resume.work_dir_for(ref).exists()

    out = tmp_path / "killed.pi2.gguf"
    work = resume.work_dir_for(out)
    proc = subprocess.Popen([*CLI, "convert", str(tiny), "-o", str(out), *FAST], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env())
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        names = [p.name for p in work.iterdir()] if work.is_dir() else []
        if any(n.startswith("profile-") for n in names) and any(n.startswith("layer-00001-") for n in names):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait(60) == -signal.SIGKILL, "the convert finished before it could be killed"
    assert not out.exists() and work.is_dir()

    res = subprocess.run([*CLI, "convert", str(tiny), "-o", str(out), *FAST], capture_output=True, text=True,
                         env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming from {work}: profile, " in res.stderr
    assert "resumed from" in res.stdout and "profile" in res.stdout  # the note of what was reused
    assert out.read_bytes() == ref.read_bytes()
    assert not work.exists()  # (d)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ref.name, out.name])  # no temp files either


def test_a_changed_option_or_model_does_not_reuse_what_it_affects(tiny: Path, tmp_path: Path, epoch: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """(b) after an interrupted convert, another --recall reuses the profile and no layer; another --train-tokens
    not even the profile; a model file touched since reuses nothing."""
    out = tmp_path / "m.pi2.gguf"
    _interrupted(tiny, out, monkeypatch)
    res = convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None, "recall": 0.95})
    note = _resumed_note(res)
    assert "profile" in note and "layer plans" not in note, res.notes
    assert "down columns" in note  # they do not depend on the recall
    assert sidecar.read(out).kv["pi2.predictor.recall_target"] == pytest.approx(0.95)
    assert not resume.work_dir_for(out).exists()

    _interrupted(tiny, out, monkeypatch)
    res = convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None, "train_tokens": 640})
    note = _resumed_note(res)
    assert "profile" not in note and "layer plans" not in note, res.notes
    assert sidecar.read(out).kv["pi2.calib.tokens"] == 640

    _interrupted(tiny, out, monkeypatch)
    st = tiny.stat()
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    res = convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None})
    assert _resumed_note(res) == "", res.notes
    assert not resume.work_dir_for(out).exists()


def test_unusable_pieces_are_computed_again(tiny: Path, tmp_path: Path, epoch: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """(c) a truncated layer piece, a profile whose arrays were edited and a down piece of garbage are each detected
    (zip errors, the checksum) and computed again: the sidecar is the uninterrupted convert's, byte for byte."""
    ref = convert_mod.convert(tiny, tmp_path / "ref.pi2.gguf", **{**FAST_KW, "perplexity_budget": None}).path
    out = tmp_path / "c.pi2.gguf"
    work = _interrupted(tiny, out, monkeypatch)
    layer = next(work.glob("layer-00000-*.npz"))
    layer.write_bytes(layer.read_bytes()[: layer.stat().st_size // 2])
    prof = next(work.glob("profile-*.npz"))
    with np.load(prof) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["train_0"] = arrays["train_0"].copy()
    arrays["train_0"][0, 0] += np.float16(1.0)  # a valid file whose contents are not what was written
    with prof.open("wb") as f:
        np.savez(f, **arrays)
    next(work.glob("down-00001-*.npz")).write_bytes(b"\0" * 100)
    res = convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None})
    bad = next(n for n in res.notes if "unusable piece" in n)
    assert "3 unusable" in bad and "checksum" in bad, bad
    assert "layer plans" in _resumed_note(res)  # layers 1 and 2 were reused
    assert out.read_bytes() == ref.read_bytes()
    assert not work.exists()


def test_no_resume_starts_fresh(tiny: Path, tmp_path: Path, epoch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """(e) --no-resume drops the pieces found and starts from the profile (and writes the same sidecar)."""
    ref = convert_mod.convert(tiny, tmp_path / "ref.pi2.gguf", **{**FAST_KW, "perplexity_budget": None}).path
    out = tmp_path / "n.pi2.gguf"
    work = _interrupted(tiny, out, monkeypatch)
    res = subprocess.run([*CLI, "convert", str(tiny), "-o", str(out), *FAST, "--perplexity-budget", "none",
                          "--no-resume"], capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--no-resume: the work directory's pieces dropped, starting fresh" in res.stderr
    assert "resuming" not in res.stderr and "resumed from" not in res.stdout
    assert "profiling 512 + 128 held-out tokens" in res.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert not work.exists()


def test_the_calibration_date_is_the_first_runs(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SOURCE_DATE_EPOCH the sidecar records when its profile was taken: a resume keeps that date."""
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    out = tmp_path / "d.pi2.gguf"
    start = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    _interrupted(tiny, out, monkeypatch)
    end = dt.datetime.now(dt.timezone.utc)
    time.sleep(1.5)
    res = convert_mod.convert(tiny, out, **{**FAST_KW, "perplexity_budget": None})
    assert "calibration date" in _resumed_note(res)
    date = dt.datetime.fromisoformat(sidecar.read(out).kv["pi2.calib.date"])
    assert start <= date <= end


def test_time_left_sums_the_known_steps_at_the_measured_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ETA: each step still to run at what its kind of unit has cost so far; a kind not yet timed guessed from the
    profiling rate; seeded from the work directory's pieces after a resume."""
    from pi2_gguf.converter import eta

    now = [0.0]
    monkeypatch.setattr(eta.time, "monotonic", lambda: now[0])
    lines: list[str] = []
    p = eta.Progress(True, train_tokens=1000, write=lines.append)
    p.expect("profile", "profile", 100)
    p.expect("layers", "layer", 10)
    p.expect("perplexity dense", "ppl_dense", 50)
    assert p.left() == (0.0, False) and p.left_text() == "time left: estimating"
    p.begin("profile", "profiling")
    now[0] = 10.0
    p.advance("profile", 50)  # 0.2 s a token
    seconds, known = p.left()
    guess_layer = eta.LAYER_PER_TRAIN_TOKEN * 0.2 * 1000
    assert known and seconds == pytest.approx(50 * 0.2 + 10 * guess_layer + 50 * 0.2)
    now[0] = 20.0
    p.advance("profile", 50)
    p.end("profile")
    p.begin("layers", "planning")
    now[0] = 23.0
    p.advance("layers", 1)  # 3 s a layer, measured: the guess is gone
    assert p.left()[0] == pytest.approx(9 * 3.0 + 50 * 0.2)
    assert lines[0].startswith("[convert 0s, time left: estimating] profiling")
    assert lines[1] == f"[convert 20s, about {eta.clock(10 * guess_layer + 10)} left] planning"

    q = eta.Progress(False, train_tokens=1000)
    q.expect("layers", "layer", 4)
    q.advance("layers", 2, timed=False)  # reused: no time, no rate
    assert q.left() == (0.0, False)
    q.seed("layer", 5.0, 1)  # what the reused piece took when it was made
    assert q.left() == (10.0, True) and q.left_text() == "about 10s left"
