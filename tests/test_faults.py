"""Faults while reading, writing and running: each ends in a clear error naming the problem, leaves no partial
output file and the inputs untouched, or (short reads, a sidecar replaced by rename) changes nothing at all.

Covered elsewhere: a bundle read failing with EIO, also a prefetch read (test_memory_budget: the generation ends
with "read of N bytes at offset M failed: Input/output error", the next one works); the sidecar truncated or
rewritten in place while generating (test_memory_budget: "changed on disk while the model was running"); the
token embedding's file changed (same); a budget too small at load (same, stating the minimum)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pi2_gguf
from pi2_gguf.converter.profile import Profile
from pi2_gguf.runtime import plugin
from pi2_gguf.runtime.generate import last_logits

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from settings import SMOL_TARGET  # noqa: E402

PROMPT = "The history of the Roman Empire"
CLI = [sys.executable, "-m", "pi2_gguf.cli"]


def _small_cache(model: Path, sidecar: Path, engine: str = "uring") -> pi2_gguf.Llama:
    """Flash decode behind a 6 MB neuron cache: most of the test model's bundles are read per token."""
    return pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="1GB", n_ctx=256, n_threads=2, verbose=False,
                          settings={"cache_max": 6 << 20, "io_engine": engine})


def _steps(llm: pi2_gguf.Llama, n: int = 12) -> np.ndarray:
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    rows = []
    for _ in range(n):
        rows.append(last_logits(llm).copy())
        llm.eval([int(np.argmax(rows[-1]))])
    return np.stack(rows)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


@pytest.mark.parametrize("engine", ["uring", "threads"])
def test_short_reads_are_completed_and_change_nothing(relu_model: tuple[Path, Path, list], engine: str) -> None:
    """Every bundle read made of 512-byte preadv calls (each returning short, as over a network file system):
    the reader resumes where each stopped, and the logits are those of whole reads, bit for bit; with either
    I/O engine (the io_uring one reads such requests with preadv on its thread)."""
    model, sidecar, _ = relu_model
    llm = _small_cache(model, sidecar, engine)
    want = _steps(llm)
    llm.close()
    llm = _small_cache(model, sidecar, engine)  # a cache as cold as the first one's
    pi2_gguf.reset_counters()
    plugin.inject_short_reads(llm.pi2_binding, 10**9)
    got = _steps(llm)
    c = pi2_gguf.read_counters()
    llm.close()
    assert int(c.misses.sum()) > 0 and int(c.bytes_read.sum()) > 0  # the cache missed: short reads were made
    assert np.array_equal(got, want)


def test_sidecar_replaced_by_rename_keeps_decoding_the_file_it_opened(relu_model: tuple[Path, Path, list],
                                                                      tmp_path: Path) -> None:
    """By design: a running model keeps the sidecar it opened (its file descriptor holds the old file, as any
    Unix reader's does), so a new sidecar renamed over the path, or the path deleted, changes nothing until the
    model is loaded again. Truncating or rewriting the opened file in place is what ends the generation."""
    model, sidecar, _ = relu_model
    copy = tmp_path / "relu.pi2.gguf"
    shutil.copyfile(sidecar, copy)
    llm = _small_cache(model, copy)
    want = _steps(llm)
    other = tmp_path / "other.pi2.gguf"
    other.write_bytes(os.urandom(1 << 20))
    other.replace(copy)  # another file under the sidecar's name
    assert np.array_equal(_steps(llm), want)
    copy.unlink()
    assert np.array_equal(_steps(llm), want)
    llm.close()


@pytest.fixture()
def small_tmpfs(tmp_path: Path):
    """A 2 MiB tmpfs: writing a sidecar there runs out of space (ENOSPC) part way."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_no_space_while_convert_writes(relu_model: tuple[Path, Path, list], small_tmpfs: Path) -> None:
    model, _, _ = relu_model
    before = _digest(model)
    out = small_tmpfs / "relu.pi2.gguf"
    r = subprocess.run([*CLI, "convert", str(model), "-o", str(out), "--train-tokens", "2048",
                        "--heldout-tokens", "512"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pi2-gguf: error: cannot write sidecar {out}: No space left on device"), r.stderr
    assert "Traceback" not in r.stderr
    # no sidecar, no temp file; the work directory stays for a rerun once there is room, and the error says where
    work = out.with_name(out.name + ".partial")
    assert _leftovers(small_tmpfs, {work.name}) == []
    if work.exists():
        assert last.endswith(f"the finished work is kept in {work}: the same command resumes from it"), last
        assert not [p.name for p in work.iterdir() if p.name.endswith(".tmp")]
    assert _digest(model) == before


def _wait_for(cond, proc: subprocess.Popen, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}:\n{err[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_convert_writes(smollm2: Path, smol_profile: Profile, tmp_path: Path, sig: int) -> None:
    """The signal arrives while the sidecar's temp file is being written: the command ends with one line and
    128 + the signal's number, the temp file is removed, the finished work kept for a rerun, the model untouched."""
    prof = smol_profile.save(tmp_path / "smol.npz")
    before = _digest(smollm2)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "smol.pi2.gguf"
    proc = subprocess.Popen([*CLI, "convert", str(smollm2), "-o", str(out), "--profile", str(prof), "--ranks", "64",
                             "--sparsity", str(SMOL_TARGET)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: any(p.name.endswith(".tmp") for p in out_dir.iterdir()), proc, 300, "the temp file appeared")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    # the sidecar's temp file is gone; the layers planned so far stay in the work directory for the same command
    work = out.with_name(out.name + ".partial")
    assert err.strip().splitlines()[-1] == \
        f"pi2-gguf: interrupted by {signal.Signals(sig).name}; stopped, no output written; the finished work is kept " \
        f"in {work}: the same command resumes from it", err
    assert "Traceback" not in err
    assert _leftovers(out_dir, {work.name}) == []
    assert not [p.name for p in work.iterdir() if p.name.endswith(".tmp")]
    assert _digest(smollm2) == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_generating(smollm2: Path, smol_sidecar: Path, sig: int) -> None:
    """pi2-gguf run on flash under a budget, signalled while it decodes: one line, 128 + the signal's number."""
    proc = subprocess.Popen([*CLI, "run", str(smollm2), "--sidecar", str(smol_sidecar), "--memory-budget", "400MB",
                             "-n", "3000", "--ctx", "4096", "-p", PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = Path(f"/proc/{proc.pid}/status")

    def decoding() -> bool:  # the reader exists once the neuron cache is made, i.e. the model loaded
        try:
            fds = list(Path(f"/proc/{proc.pid}/fd").iterdir())
            if any("io_uring" in os.readlink(fd) for fd in fds):  # the io_uring reader's ring
                return True
            return int(next(x for x in status.read_text().splitlines() if x.startswith("Threads:")).split()[1]) > 4
        except (OSError, StopIteration):  # (a descriptor closed while listed)
            return False

    _wait_for(decoding, proc, 120, "the model loaded")
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith(f"pi2-gguf: interrupted by {signal.Signals(sig).name}"), err
    assert "Traceback" not in err


OOM_SCRIPT = r"""
import resource, sys
import pi2_gguf
from pi2_gguf.errors import MemoryBudgetError
from pi2_gguf.runtime import plugin

set_budget = plugin.set_budget

def with_address_space_nearly_full(binding, budget, reserved):
    # the model is loaded; what the neuron cache maps next cannot fit in the address space left
    vm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
    set_budget(binding, budget, reserved)

plugin.set_budget = with_address_space_nearly_full
try:
    pi2_gguf.Llama(sys.argv[1], sidecar=sys.argv[2], memory_budget="1GB", n_ctx=256, n_threads=2, verbose=False)
except MemoryBudgetError as e:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("refused:", e)
    sys.exit(3)
print("loaded")
"""


def test_memory_exhausted_while_the_cache_is_made(relu_model: tuple[Path, Path, list]) -> None:
    """The neuron cache's memory cannot be had (an address-space limit just above what the loaded model uses):
    the load fails with an error naming the sidecar and the size, not a crash."""
    model, sidecar, _ = relu_model
    r = subprocess.run([sys.executable, "-c", OOM_SCRIPT, str(model), str(sidecar)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"refused: sidecar {sidecar}: out of memory for a neuron cache of" in r.stdout, r.stdout
