"""libFuzzer targets (ASan + UBSan) of the plugin's readers of file bytes: ggml-backend/fuzz/, run by tools/fuzz.sh.
Every input under tests/fuzz_regressions/TARGET/ (a crash the fuzzer found, fixed since) is replayed through its
target; then each target is fuzzed for 60 seconds from the seed corpora (marked `fuzz`, selected by default:
CI runs them; -m "not fuzz" leaves them out). Without clang they are skipped, except in CI (CI set), where they
fail: .ci/run installs clang."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "tools" / "fuzz.sh"
REGRESSIONS = Path(__file__).parent / "fuzz_regressions"
TARGETS = ["sidecar", "model_summary", "embedding_rows", "config"]


def _need_clang() -> None:
    if shutil.which("clang") is None:
        if os.environ.get("CI"):
            pytest.fail("clang missing: .ci/run installs clang and libclang-rt-dev (libFuzzer, ASan, UBSan)")
        pytest.skip("no clang (apt-get install clang libclang-rt-dev): the fuzz targets need clang's libFuzzer")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FUZZ), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _tail(r: subprocess.CompletedProcess[str], n: int = 60) -> str:
    return "\n".join((r.stdout + r.stderr).splitlines()[-n:])


def test_fuzz_sh_lists_the_targets() -> None:
    r = _run(["--list"], 30)
    assert r.returncode == 0 and r.stdout.split() == TARGETS, r.stdout + r.stderr
    for t in TARGETS:
        assert (ROOT / "ggml-backend" / "fuzz" / f"fuzz_{t}.c").is_file()
    unknown = [d.name for d in REGRESSIONS.iterdir() if d.is_dir() and d.name not in TARGETS]
    assert not unknown, f"tests/fuzz_regressions/ has directories of no target: {unknown}"


def test_dictionary_holds_every_sidecar_key_and_tensor() -> None:
    fmt = (ROOT / "ggml-backend" / "src" / "model" / "sidecar_format.h").read_text()
    names = re.findall(r'#define PI2_(?:KEY|TENSOR|OPTIONAL_TENSOR)_\w+\s+"([^"]+)"', fmt)
    assert len(names) > 40
    entries = set(re.findall(r'^\w+="([^"]*)"$', (ROOT / "ggml-backend" / "fuzz" / "gguf.dict").read_text(), re.M))
    missing = [n for n in names if n not in entries and f"blk.0.{n}" not in entries]
    assert not missing, f"ggml-backend/fuzz/gguf.dict lacks {missing}"


@pytest.mark.parametrize("target", TARGETS)
def test_regressions_replay(target: str) -> None:
    """Builds the target (a compile error fails here) and runs every saved crash input through it once."""
    _need_clang()
    inputs = sorted(p for p in (REGRESSIONS / target).rglob("*") if p.is_file()) if (REGRESSIONS / target).is_dir() else []
    r = _run(["--replay", target, *map(str, inputs)] if inputs else ["--build", target], 600)
    assert r.returncode == 0, _tail(r)
    if inputs:
        assert f"{len(inputs)} inputs replayed, no failure" in r.stdout, _tail(r)


@pytest.mark.fuzz
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_60_seconds(target: str, tmp_path: Path) -> None:
    """One minute of fuzzing from the seeds (made once into build/fuzz/seeds/, about 90 s) in a fresh work corpus;
    any crash, leak, timeout or sanitizer report fails, naming the input (tools/fuzz.sh --replay reproduces it)."""
    _need_clang()
    r = _run([target, "1", "--corpus", str(tmp_path / "corpus")], 900)
    summary = [line for line in r.stdout.splitlines() if line.startswith(f"fuzz.sh: {target}:")]
    assert r.returncode == 0, _tail(r)
    assert any("no crash, leak or sanitizer report" in line for line in summary), _tail(r)
    execs = re.search(r": (\d+) executions", "\n".join(summary))
    assert execs and int(execs.group(1)) > 1000, _tail(r)
