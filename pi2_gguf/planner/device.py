"""This machine, measured once: O_DIRECT random reads of the sidecar file itself (no extra disk) at the request
sizes a memory budget issues, and per-core compute throughput of ggml-cpu's dot products (the kernels llama.cpp and
the plugin compute with) on the model's weight types, with 1 and 2 threads. Cached as JSON under
`<cache dir>/plan/`, keyed by the host, the CPU model and the block device the file lives on; `--remeasure` drops it.

Reads land where the engine's land: in memory advised to huge pages (its neuron cache is), 2 MiB-aligned. Here that
doubles what O_DIRECT reaches (0.8-0.9 against 1.7-2.1 GB/s at 100 KB-1 MiB, 8 in flight): the kernel pins every
destination page of a direct read, and 4 KiB pages cost it 256 pins a MiB. A request the engine scatters into
several cache entries (one per bundle) pays again per segment, so that is measured too, at each bundle size.

Limits, stated: reads come from Python threads blocking in `preadv` (the plugin submits through io_uring, 32 in
flight), so very small requests may be measured below the disk's request rate; compute is timed on random values
quantized to each type (a dot product's speed does not depend on the values) over 64 MB of weights, more than the
CPU's caches, as decode streams them."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import mmap
import os
import platform
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import Pi2Error

CACHE_VERSION = 4  # 2: compute timed by the plugin's own kernel; 3: reads in file order; 4: into huge pages,
                   # and scattered into bundle-sized segments
READ_THREADS = 8          # reads in flight while the throughput at a size is measured
READ_SECONDS = 0.35       # per size, the concurrent part; as long again for the one-at-a-time latency
COMPUTE_SECONDS = 0.6     # per type and thread count, in COMPUTE_SAMPLES samples
COMPUTE_SAMPLES = 3
COMPUTE_BYTES = 64 << 20  # weights a dot-product pass streams (beyond the CPU's caches)
ROW_VALUES = 4096         # values a timed row holds: whole blocks of every type, a 7B model's n_embd
IO_ALIGN = 4096
HUGE_PAGE = 2 << 20
SEGMENT_ALIGN = 512       # O_DIRECT's alignment of each iovec's length (a sector)
SEGMENTED_BYTES = 512 << 10  # a scattered request measured: about this many bytes of whole bundles, 4 to 64 of them


@dataclass
class ReadPoint:
    size: int             # bytes per request
    latency_s: float      # one request alone (median)
    throughput_bps: float  # READ_THREADS requests in flight, random aligned offsets
    direct: bool          # O_DIRECT (else buffered with the page cache dropped)
    segments: int = 1     # iovecs each request is scattered into (1: one contiguous destination)


@dataclass
class DeviceProfile:
    key: str
    machine: dict[str, str]
    reads: dict[str, ReadPoint] = field(default_factory=dict)   # str(size) -> point
    compute: dict[str, float] = field(default_factory=dict)     # "TYPE@threads" -> weight bytes/s
    measured: list[str] = field(default_factory=list)           # what this call measured (not cached)

    def read_points(self) -> list[ReadPoint]:
        """The contiguous requests, by size."""
        return sorted((p for p in self.reads.values() if p.segments == 1), key=lambda p: p.size)

    def segment_cost(self, bundle: int) -> float:
        """Seconds a request takes longer (READ_THREADS in flight) for each iovec beyond its first when it is scattered
        into entries of `bundle` bytes: from the scattered and contiguous reads of the same size measured for that
        bundle size (0 where none was)."""
        seg = self.reads.get(_segmented_key(bundle))
        if seg is None:
            return 0.0
        whole = self.reads.get(str(seg.size))
        if whole is None or seg.segments < 2:
            return 0.0
        extra = seg.size / seg.throughput_bps - seg.size / whole.throughput_bps
        return max(extra, 0.0) / (seg.segments - 1)

    def request_cost(self) -> tuple[float, float]:
        """(seconds per request with READ_THREADS in flight, seconds per byte): the least-squares line through the
        measured sizes of size / throughput = a + size * b, so that n requests of s bytes take n * a + n * s * b."""
        pts = self.read_points()
        if not pts:
            raise Pi2Error("no read measurements")
        x = np.array([p.size for p in pts], dtype=np.float64)
        y = np.array([p.size / p.throughput_bps for p in pts], dtype=np.float64)
        if len(pts) == 1:
            return 0.0, float(y[0] / x[0])
        b, a = np.polyfit(x, y, 1)
        if a < 0 or b <= 0:  # noise: fall back to the largest size's bandwidth
            return 0.0, float(y[-1] / x[-1])
        return float(a), float(b)

    def latency(self, size: float) -> float:
        """One request alone, interpolated in log size between the measured sizes."""
        pts = self.read_points()
        xs = np.log([p.size for p in pts])
        return float(np.interp(np.log(max(size, 1.0)), xs, [p.latency_s for p in pts]))

    def compute_bps(self, type_name: str, threads: int) -> float:
        """Weight bytes a second the dot products of this type stream with `threads` threads (the nearest thread count
        measured, scaled linearly beyond it)."""
        counts = sorted(int(k.split("@")[1]) for k in self.compute if k.split("@")[0] == type_name)
        if not counts:
            raise Pi2Error(f"no compute measurement for {type_name}")
        best = max((c for c in counts if c <= threads), default=counts[0])
        return self.compute[f"{type_name}@{best}"] * threads / best


# --- the machine's identity ---------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _block_device(path: Path) -> str:
    """The block device a file lives on (name from sysfs where known, else major:minor)."""
    dev = path.stat().st_dev
    mm = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        for line in Path(f"/sys/dev/block/{mm}/uevent").read_text().splitlines():
            if line.startswith("DEVNAME="):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return mm


def machine(path: Path) -> dict[str, str]:
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "cores": str(os.cpu_count() or 1),
            "disk": _block_device(path)}


def cache_path(cache_root: Path, ident: dict[str, str]) -> tuple[str, Path]:
    key = "|".join(f"{k}={ident[k]}" for k in sorted(ident))
    return key, cache_root / "plan" / f"device-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load(path: Path, key: str) -> DeviceProfile | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("version") != CACHE_VERSION or raw.get("key") != key:
        return None
    try:
        reads = {k: ReadPoint(**v) for k, v in raw["reads"].items()}
        return DeviceProfile(key, dict(raw["machine"]), reads, {k: float(v) for k, v in raw["compute"].items()})
    except (KeyError, TypeError, ValueError):
        return None


def _save(path: Path, prof: DeviceProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": CACHE_VERSION, "key": prof.key, "machine": prof.machine,
            "reads": {k: asdict(v) for k, v in prof.reads.items()}, "compute": prof.compute}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# --- reads -----------------------------------------------------------------------------------------------

def _open_direct(path: Path) -> tuple[int, bool]:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags), bool(getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY), False


class _HugeBuffer:
    """`size` bytes of anonymous memory, 2 MiB-aligned and advised to huge pages as the engine's cache is, touched
    so that they are faulted in before a read is timed."""

    def __init__(self, size: int) -> None:
        span = -(-size // HUGE_PAGE) * HUGE_PAGE
        # private: shared anonymous memory is shmem, which takes huge pages only where shmem_enabled says so
        self._map = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._off = (-addr) % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._off, span)
            except OSError:
                pass  # advice only: without huge pages the reads are measured as they then are
        self.view = memoryview(self._map)[self._off:self._off + size]
        self.view[:] = bytes(size)

    def close(self) -> None:
        self.view.release()
        self._map.close()


def _segments(buf: _HugeBuffer, size: int, segment: int) -> list[memoryview]:
    """The destination iovecs of one request: one buffer, or `size // segment` entries of `segment` bytes spread over
    twice the room, in the reverse order, as a cache's free entries are."""
    if segment <= 0 or segment >= size:
        return [buf.view[:size]]
    n = size // segment
    return [buf.view[(n - 1 - k) * 2 * segment:(n - 1 - k) * 2 * segment + segment] for k in range(n)]


def _segmented_key(bundle: int) -> str:
    return f"{_segmented_size(bundle)}/{_segment(bundle)}"


def _segment(bundle: int) -> int:
    return -(-int(bundle) // SEGMENT_ALIGN) * SEGMENT_ALIGN


def _segmented_size(bundle: int) -> int:
    """The size of the scattered request measured for a bundle size: whole bundles, 4 to 64 of them, about
    SEGMENTED_BYTES."""
    seg = _segment(bundle)
    return seg * min(max(SEGMENTED_BYTES // seg, 4), 64)


def measure_reads(path: Path, size: int, threads: int = READ_THREADS, seconds: float = READ_SECONDS,
                  seed: int = 0, segment: int = 0) -> ReadPoint:
    """Reads of `size` bytes (rounded up to 4 KiB) from the file, O_DIRECT where the file system takes it (else
    buffered after dropping the file's cached pages): the latency of one alone at a random 4 KiB-aligned offset, and
    the throughput with `threads` in flight in ascending file order from a random start, as the engine reads a
    layer's missing bundles (in order, several requests in flight; random offsets measured about half of what the
    engine then reached here: 0.9-1.0 against 1.8-2.0 GB/s, docs/MEASUREMENTS.md 2026-11-28). With `segment`, each
    request is scattered into iovecs of that many bytes (size must then be a multiple of it)."""
    if segment <= 0:
        size = -(-size // IO_ALIGN) * IO_ALIGN
    elif segment % SEGMENT_ALIGN or size % segment:
        raise Pi2Error(f"a scattered read of {size} bytes needs whole {SEGMENT_ALIGN}-byte-aligned segments, "
                       f"not {segment}")
    fsize = path.stat().st_size
    if fsize < size + IO_ALIGN:
        raise Pi2Error(f"{path} ({fsize} bytes) is too small to measure {size}-byte reads from")
    span = (fsize - size) // IO_ALIGN
    fd, direct = _open_direct(path)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rng = random.Random(seed)
        room = 2 * size if segment > 0 else size
        buf = _HugeBuffer(room)
        iov: list[memoryview] = []
        try:
            iov = _segments(buf, size, segment)
            lat: list[float] = []
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop or len(lat) < 8:
                off = rng.randrange(span) * IO_ALIGN
                t0 = time.perf_counter()
                os.preadv(fd, iov, off)
                lat.append(time.perf_counter() - t0)
                if len(lat) >= 2000:
                    break
        finally:
            del iov
            buf.close()
        done = [0] * threads
        errors: list[OSError] = []
        n_slots = max(span * IO_ALIGN // size, 1)  # whole requests the file holds
        start = rng.randrange(n_slots)
        taken = itertools.count()  # next() is atomic under the GIL: each request is handed out once

        def worker(i: int) -> None:
            b = _HugeBuffer(room)
            v = _segments(b, size, segment)
            try:
                while time.perf_counter() < deadline:
                    os.preadv(fd, v, ((start + next(taken)) % n_slots) * size)
                    done[i] += 1
            except OSError as e:
                errors.append(e)
            finally:
                del v
                b.close()

        deadline = time.perf_counter() + seconds
        t0 = time.perf_counter()
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise Pi2Error(f"reading {path} to measure the disk: {errors[0]}")
    finally:
        os.close(fd)
    return ReadPoint(size, float(np.median(lat)), sum(done) * size / elapsed, direct,
                     size // segment if segment > 0 else 1)


# --- compute ---------------------------------------------------------------------------------------------

def measure_compute(qtype: int, threads: int, seconds: float = COMPUTE_SECONDS) -> float:
    """Weight bytes a second of the plugin's own decode product (pi2_time_dense_rows: one token, row spans over
    `threads` OpenMP threads, ggml-cpu's dot products) over COMPUTE_BYTES of rows of ROW_VALUES values of type
    qtype: the kernel and threading a decode runs, from beyond the CPU's caches."""
    from gguf import GGMLQuantizationType

    from ..runtime import capi
    from ..sidecar.format import row_size

    n_rows = max(COMPUTE_BYTES // row_size(qtype, ROW_VALUES), 1)
    best = 0.0
    for _ in range(COMPUTE_SAMPLES):  # the fastest sample: a shared machine's other work only ever slows one
        out = ctypes.c_double()
        if capi.lib().pi2_time_dense_rows(qtype, ROW_VALUES, n_rows, threads, seconds / COMPUTE_SAMPLES,
                                          ctypes.byref(out)) != 0:
            raise Pi2Error(f"the plugin cannot time {GGMLQuantizationType(qtype).name} dot products (no dot product, "
                           "or quantizing it needs an importance matrix)")
        best = max(best, float(out.value))
    return best


# --- the profile -----------------------------------------------------------------------------------------

def read_sizes(bundle_sizes: Iterable[int], max_request: int = 1 << 20) -> list[int]:
    """The request sizes a budget issues: each bundle size (4 KiB-rounded), and requests of bridged and consecutive
    bundles up to PI2_IO_MAX_BYTES (powers of two from 16 KiB)."""
    sizes = {-(-int(s) // IO_ALIGN) * IO_ALIGN for s in bundle_sizes if s > 0}
    s = 16 << 10
    while s <= max_request:
        sizes.add(s)
        s *= 2
    return sorted(sizes)


def profile(file: Path, sizes: list[int], types: dict[str, int], threads: list[int], cache_root: Path,
            remeasure: bool = False, progress: Callable[[str], None] | None = None,
            bundles: Iterable[int] = ()) -> DeviceProfile:
    """The device profile for reads of `file`'s disk at `sizes`, scattered reads into entries of each of `bundles`
    bytes, and compute on `types` (name -> ggml type) with each thread count: from the cache, measuring (and caching)
    only what it lacks; all of it with remeasure."""
    ident = machine(file)
    key, path = cache_path(cache_root, ident)
    prof = None if remeasure else _load(path, key)
    if prof is None:
        prof = DeviceProfile(key, ident)
    fsize = file.stat().st_size
    for size in sizes:
        size = -(-size // IO_ALIGN) * IO_ALIGN
        if str(size) in prof.reads or fsize < size + IO_ALIGN:
            continue
        if progress:
            progress(f"measuring {size // 1024} KiB reads of {file.name} (O_DIRECT) ...")
        prof.reads[str(size)] = measure_reads(file, size)
        prof.measured.append(f"read {size}")
    for bundle in sorted({int(b) for b in bundles if b > 0}):
        size, seg = _segmented_size(bundle), _segment(bundle)
        if _segmented_key(bundle) in prof.reads or fsize < size + IO_ALIGN:
            continue
        if progress:
            progress(f"measuring {size // 1024} KiB reads scattered into {seg}-byte entries ...")
        if str(size) not in prof.reads:  # its contiguous twin, of exactly that size
            prof.reads[str(size)] = measure_reads(file, size, segment=size)
            prof.measured.append(f"read {size}")
        prof.reads[_segmented_key(bundle)] = measure_reads(file, size, segment=seg)
        prof.measured.append(f"read {size} in {size // seg}")
    if not prof.read_points():
        raise Pi2Error(f"{file} is too small to measure reads from")
    for name, qtype in sorted(types.items()):
        for t in threads:
            k = f"{name}@{t}"
            if k in prof.compute:
                continue
            if progress:
                progress(f"measuring {name} dot products on {t} thread{'s' if t > 1 else ''} ...")
            try:
                prof.compute[k] = measure_compute(qtype, t)
            except Pi2Error:
                continue  # a type ggml cannot quantize without an importance matrix: its neighbours stand in
            prof.measured.append(f"compute {k}")
    if prof.measured:
        _save(path, prof)
    return prof
