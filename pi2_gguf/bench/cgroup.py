"""Runs a command like a device with little memory: a cgroup v1 memory limit (RSS and page cache of the
whole process tree), optional blkio read caps (phone flash), and a cold page cache (the files' pages
dropped with drop_caches before the run), so the page cache cannot hold the model for it. Needs root and
cgroup v1."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import Pi2Error
from ..runtime.memory_budget import drop_page_cache

ROOT = Path("/sys/fs/cgroup")


class CgroupError(Pi2Error):
    """cgroup v1 memory/blkio controllers are missing or not writable (root is needed)."""


@dataclass
class CgroupRun:
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    peak_bytes: int        # memory.max_usage_in_bytes: RSS + page cache, at its highest
    oom_kills: int
    major_faults: int
    disk_read_bytes: int   # blkio: bytes the group read from block devices
    disk_reads: int
    timed_out: bool = False


def available() -> str | None:
    """None when runs can be limited here; else why not."""
    if os.geteuid() != 0:
        return "memory limits need root (cgroup v1)"
    for c in ("memory", "blkio"):
        if not (ROOT / c / "cgroup.procs").is_file():
            return f"cgroup v1 {c} controller not mounted at {ROOT / c}"
    return None


def drop_caches(files: list[Path]) -> None:
    """Cold page cache: sync, drop everything, and evict these files (pages cached by another group are
    not charged to a new one, so a warm cache would hide reads)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    for f in files:
        drop_page_cache(f)


def _block_device(path: Path) -> str:
    """MAJ:MIN of the whole disk holding path (blkio throttles whole devices)."""
    src = subprocess.run(["findmnt", "-no", "SOURCE", "-T", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    parent = subprocess.run(["lsblk", "-no", "PKNAME", src], capture_output=True, text=True).stdout.strip().splitlines()
    dev = f"/dev/{parent[0]}" if parent and parent[0] else src
    return subprocess.run(["lsblk", "-dno", "MAJ:MIN", dev], capture_output=True, text=True, check=True).stdout.strip()


def _stat(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def _blkio_sum(path: Path) -> int:
    total = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            total += int(parts[2])
    return total


def run(cmd: list[str], memory_limit: int | None, files: list[Path], read_bps: int | None = None,
        read_iops: int | None = None, cold: bool = True, timeout: float | None = None,
        env: dict[str, str] | None = None) -> CgroupRun:
    """Runs cmd in fresh memory and blkio cgroups and reports what it used."""
    why = available()
    if why:
        raise CgroupError(why)
    name = f"pi2-gguf.{os.getpid()}.{time.monotonic_ns()}"
    mem, blk = ROOT / "memory" / name, ROOT / "blkio" / name
    mem.mkdir()
    blk.mkdir()
    try:
        if memory_limit:
            (mem / "memory.limit_in_bytes").write_text(str(memory_limit))
            swap = mem / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory_limit))
        # a rule on the device also turns on the group's read accounting (1 PB/s when uncapped)
        dev = _block_device(files[0] if files else Path.cwd())
        (blk / "blkio.throttle.read_bps_device").write_text(f"{dev} {read_bps or 10**15}")
        if read_iops:
            (blk / "blkio.throttle.read_iops_device").write_text(f"{dev} {read_iops}")
        if cold:
            drop_caches(files)

        def enter() -> None:  # in the child, before exec: join both groups
            pid = str(os.getpid())
            (mem / "cgroup.procs").write_text(pid)
            (blk / "cgroup.procs").write_text(pid)

        t0 = time.perf_counter()
        timed_out = False
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=enter,
                              env=env) as p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                timed_out = True
        wall = time.perf_counter() - t0
        oom = _stat(mem / "memory.oom_control", "oom_kill")
        return CgroupRun(p.returncode, out, err, wall, int((mem / "memory.max_usage_in_bytes").read_text()), oom,
                         _stat(mem / "memory.stat", "total_pgmajfault"),
                         _blkio_sum(blk / "blkio.throttle.io_service_bytes"), _blkio_sum(blk / "blkio.throttle.io_serviced"),
                         timed_out)
    finally:
        for cg in (mem, blk):
            for pid in (cg / "cgroup.procs").read_text().split():
                try:
                    (cg.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            if cg == mem:
                try:
                    (mem / "memory.force_empty").write_text("0")
                except OSError:
                    pass
            try:
                cg.rmdir()
            except OSError:
                pass
