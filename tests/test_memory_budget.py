"""Flash-resident FFN under a memory budget: decoding equals the in-RAM sparse decode bit for bit, a
budget too small is refused with its minimum, read errors and a sidecar changed while running end the
generation with a clear error, and under a cgroup limit equal to the budget the process stays within it."""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

import pi2_gguf
from pi2_gguf.bench import cgroup
from pi2_gguf.converter.convert import convert
from pi2_gguf.errors import MemoryBudgetError, SidecarError
from pi2_gguf.planner import model_stats
from pi2_gguf.runtime import plugin
from pi2_gguf.runtime.counters import CacheInfo
from pi2_gguf.runtime.generate import last_logits
from pi2_gguf.runtime.isolated import greedy_command, parse_results
from pi2_gguf.runtime.memory_budget import parse_size
from pi2_gguf.sidecar import format as fmt
from pi2_gguf.sidecar.reader import read as read_sidecar

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from gguf_copy import copy_gguf  # noqa: E402
from kernel_probe import io_uring_available  # noqa: E402
from settings import SMOL_TARGET  # noqa: E402

PROMPT = "The history of the Roman Empire"
N_STEPS = 16
# the sidecar's bundles even where the budget holds every FFN layer whole (PI2_DENSE_READS=auto reads those from the
# model file): for tests of the neuron cache under a roomy budget
BUNDLES = {"dense_reads": "bundles"}


def test_parse_size() -> None:
    assert parse_size("600MB") == 600_000_000
    assert parse_size("0.5 GiB") == 2**29
    assert parse_size("1500000000") == 1_500_000_000
    assert parse_size(4096) == 4096
    for bad in ("", "600XB", "-5MB", "0", "MB"):
        with pytest.raises(MemoryBudgetError, match="not a"):
            parse_size(bad)


def _steps(llm: pi2_gguf.Llama, n: int = N_STEPS) -> np.ndarray:
    """Logits after the prompt and after each of n greedy steps."""
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    rows = []
    for _ in range(n):
        row = last_logits(llm).copy()
        rows.append(row)
        llm.eval([int(np.argmax(row))])
    return np.stack(rows)


# In RAM, prompts and many-active tokens take other kernels (ggml-cpu, the model's down rows); on flash a prompt
# runs as a batch (batch_ffn.h). Comparing the sparse engine with itself needs those off: in RAM both, on flash
# the batch (FLASH_SAME_ENGINE).
SAME_ENGINE = {"sparse_batch": 64, "down_sparse_max": 1.0}
FLASH_SAME_ENGINE = {"sparse_batch": 64}


def _minimum(model: Path, sidecar: Path, settings: dict[str, int] | None = None) -> int:
    """The smallest budget the plugin accepts for this model now (from its refusal of 1 MB), with these settings."""
    with pytest.raises(MemoryBudgetError) as e:
        pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="1MB", n_ctx=256, n_threads=2, verbose=False,
                       settings=settings)
    m = re.search(r"needs (?:at least|more than) (\d+) MB", str(e.value))
    assert m, str(e.value)
    return int(m.group(1)) * 1_000_000


def _load_minimum(model: Path, sidecar: Path, settings: dict[str, int] | None = None) -> int:
    """The plugin's own minimum for this model now, which counts what loading made resident: the budget it refuses
    once loaded at the files' cheaper bound (_minimum); that bound where the load fits. The bound leaves the process's
    growth out: after other tests have loaded and converted models in this process it fell 46 MB short."""
    bound = _minimum(model, sidecar, settings) + 1_000_000  # it needs more than the bound
    try:
        llm = pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget=bound, n_ctx=256, n_threads=2, verbose=False,
                             settings=settings)
    except MemoryBudgetError as e:
        m = re.search(r"needs at least (\d+) MB", str(e))
        assert m, str(e)
        return int(m.group(1)) * 1_000_000
    llm.close()
    return bound


def _load_small_cache(model: Path, sidecar: Path, mode: str = "predicted",
                      settings: dict[str, str] | None = None) -> pi2_gguf.Llama:
    """A budget of 1 GB, its neuron cache capped at 6 MB (PI2_CACHE_MAX): the test model's 16 MB of bundles
    then mostly stay on flash, whatever this test process holds. settings: more of this model's settings."""
    return pi2_gguf.Llama(str(model), sidecar=sidecar, mode=mode, memory_budget="1GB", n_ctx=256, n_threads=2,
                          verbose=False, settings={"cache_max": 6 << 20, **(settings or {})})


def _ram_then_flash(model: Path, ram_sidecar: Path, flash_sidecar: Path, mode: str = "predicted",
                    n: int = N_STEPS, flash_settings: dict[str, str] | None = None
                    ) -> tuple[np.ndarray, np.ndarray, pi2_gguf.Counters, CacheInfo]:
    """Logits of n greedy steps all in RAM, then on flash behind the small cache (_load_small_cache, with
    flash_settings too); with the flash run's counters and its cache."""
    ram = pi2_gguf.Llama(str(model), sidecar=ram_sidecar, mode=mode, n_ctx=256, n_threads=2, verbose=False,
                         settings=SAME_ENGINE)
    want = _steps(ram, n)
    ram.close()
    flash = _load_small_cache(model, flash_sidecar, mode, {**FLASH_SAME_ENGINE, **(flash_settings or {})})
    pi2_gguf.reset_counters()
    got = _steps(flash, n)
    c = pi2_gguf.read_counters()
    info = flash.cache_info()
    flash.close()
    assert info is not None
    return want, got, c, info


_LLAMA_REPORT = r"""
import ctypes, json, re, sys
import llama_cpp
from pi2_gguf.runtime import plugin
from pi2_gguf.runtime.llama_memory import llama_memory

logged = []

@llama_cpp.llama_log_callback
def capture(level, text, user_data):
    m = re.search(r"(\S+) compute buffer size\s*=\s*([0-9.]+)\s*MiB", text.decode("utf-8", "replace"))
    if m:
        logged.append(float(m.group(2)))

llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
if sys.argv[2] == "pi2":
    plugin.register()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_batch=int(sys.argv[3]), n_ubatch=int(sys.argv[3]), verbose=True)
mem = llama_memory(llm._ctx.ctx)
print(json.dumps({"logged_mib": logged, "compute": mem.compute, "context": mem.context, "model": mem.model}))
"""


@pytest.mark.parametrize("host,n_batch", [("stock", 32), ("pi2", 32), ("pi2", 128)])
def test_compute_buffers_are_llama_cpp_s_own_report(smollm2: Path, host: str, n_batch: int) -> None:
    """A budget reserves llama's compute buffers from llama.cpp's own report (llama_get_memory_breakdown through
    host/llama_memory.cpp), not its log: the report equals the sizes llama logs, to the log's 0.01 MiB, with and
    without PI2 and at two batch sizes (the buffers grow with n_ubatch)."""
    r = subprocess.run([sys.executable, "-c", _LLAMA_REPORT, str(smollm2), host, str(n_batch)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["logged_mib"], "llama logged no compute buffer size"
    assert abs(got["compute"] / 2**20 - sum(got["logged_mib"])) <= 0.01 * len(got["logged_mib"]), got
    assert got["compute"] > 1 << 20 and got["context"] > 0 and got["model"] > 0, got
    if n_batch == 128:  # llama sizes compute buffers by n_ubatch: the report follows it
        small = subprocess.run([sys.executable, "-c", _LLAMA_REPORT, str(smollm2), host, "32"],
                               capture_output=True, text=True, timeout=300)
        assert small.returncode == 0, small.stderr[-2000:]
        assert json.loads(small.stdout.strip().splitlines()[-1])["compute"] < got["compute"]



@pytest.mark.parametrize("mode", ["predicted", "oracle"])
def test_budget_decode_equals_in_ram_sparse_decode(relu_model: tuple[Path, Path, list], mode: str) -> None:
    model, sidecar, _ = relu_model
    want, got, c, info = _ram_then_flash(model, sidecar, sidecar, mode)
    assert info.n_cold > 0 and info.hot_bytes + info.cold_bytes <= 6 << 20
    # the plan spends the whole cache: the cold segment gets what the hot one leaves, to the last entry
    assert info.hot_bytes + info.cold_bytes > (6 << 20) - fmt.BUNDLE_ALIGN and info.hot_neurons > 0
    assert np.array_equal(got, want)  # bit for bit: same kernels, same order, bundles as read from the file
    # the smallest cache leaves most neurons on flash: they were read, and the counters add up
    needed = int(c.hot_hits.sum() + c.cold_hits.sum() + c.misses.sum())
    assert int(c.misses.sum()) > 0 and int(c.hot_hits.sum()) > 0
    assert needed == int(c.predicted.sum())  # every neuron whose gate was computed came through the cache
    sc = read_sidecar(sidecar)  # one neuron to a bundle: a miss reads at least its bundle
    assert int(c.bytes_read.sum()) >= int(c.misses.sum()) * min(sc.layout(il).size for il in range(sc.n_layer))


@pytest.mark.parametrize("engine", ["uring", "threads"])
def test_io_engines_decode_as_in_ram(relu_model: tuple[Path, Path, list], engine: str) -> None:
    """Bundle reads through io_uring (PI2_IO_ENGINE=uring, the default, where the kernel allows it) and on
    I/O threads: either way the logits are the in-RAM decode's bit for bit, and the cache says which read."""
    model, sidecar, _ = relu_model
    want, got, c, info = _ram_then_flash(model, sidecar, sidecar, "predicted", flash_settings={"io_engine": engine})
    assert int(c.misses.sum()) > 0 and int(c.io_requests.sum()) > 0
    assert np.array_equal(got, want)
    assert info.io_ring == (engine == "uring" and io_uring_available())


def test_budget_decode_of_a_product_sidecar_equals_in_ram(smollm2: Path, smol_sidecar: Path) -> None:
    """SmolLM2 with the default product criterion (up rows for the admitted neurons, down columns for the
    active ones): on flash as in RAM, bit for bit. The output matrix stays in RAM (the sidecar records output rows
    for SmolLM2's tied Q8_0 table, whose logits outside the exact rows come from a Q4_0 copy under a budget)."""
    assert max(int(n) for n in read_sidecar(smol_sidecar).kv["pi2.bundle.neurons"]) > 1  # packed bundles
    want, got, c, _ = _ram_then_flash(smollm2, smol_sidecar, smol_sidecar, "oracle", 4, {"output_rows": "0"})
    assert np.array_equal(got, want)
    assert int(c.misses.sum()) > 0
    assert 0.4 < c.active.sum() / c.neurons.sum() < 0.6 < 0.85 < c.rows[:, 1].sum() / c.neurons.sum() < 0.95


def test_bundle_type_decodes_alike_in_ram_and_on_flash(smollm2: Path, smol_sidecar: Path, smol_q40_sidecar: Path) -> None:
    """A sidecar whose bundles hold Q4_0 rows of the Q4_1 model: in RAM, predicted layers without a predictor
    compute from the bundles, not from the model's own rows (a Q4_0 dot over Q4_1 bytes would be garbage),
    so RAM and flash give the same logits; they differ from the model-typed sidecar's only by quantization."""
    want, got, c, _ = _ram_then_flash(smollm2, smol_q40_sidecar, smol_q40_sidecar, "predicted", 4)
    assert int(c.misses.sum()) > 0
    assert np.array_equal(got, want)
    # the prompt's logits (later steps follow each run's own greedy tokens): 0.17 apart measured; a dot of the
    # wrong type over the model's rows gives logits as far apart as they are long, or more
    base, _, _, _ = _ram_then_flash(smollm2, smol_sidecar, smol_sidecar, "predicted", 1)
    rel = float(np.linalg.norm(want[0] - base[0]) / np.linalg.norm(base[0]))
    assert 0.0 < rel < 0.3, rel


def test_next_layer_prefetch_changes_nothing_but_timing(smollm2: Path, smol_sidecar: Path) -> None:
    """SmolLM2's product layers run without predictors (every bundle read each token), so while a layer
    finishes the cache reads the next layer's first bundles into entries kept for that. The same logits,
    and the same misses and bytes counted as without the prefetch."""
    runs = []
    for env in ({"PI2_PREFETCH_BYTES": "0"}, None):
        flash = _load_small_cache(smollm2, smol_sidecar, settings=env)
        pi2_gguf.reset_counters()
        logits = _steps(flash, 4)
        c, info = pi2_gguf.read_counters(), flash.cache_info()
        flash.close()
        runs.append((logits, c, info))
    (off, c_off, info_off), (on, c_on, info_on) = runs
    assert info_off.n_prefetch == 0 < info_on.n_prefetch <= (info_on.n_cold - 1) // 2
    assert np.array_equal(on, off)
    # the prefetch reads some of the misses, and the request that uses them reads them no more; its entries
    # come from the hot segment's share: as many neurons needed in all, no fewer misses
    assert int(c_off.prefetched.sum()) == 0 < int(c_on.prefetched.sum()) < int(c_on.misses.sum())
    assert int(c_on.misses.sum()) >= int(c_off.misses.sum()) > 0
    total = lambda c: int(c.hot_hits.sum() + c.cold_hits.sum() + c.misses.sum())  # noqa: E731
    assert total(c_on) == total(c_off)
    align = int(read_sidecar(smol_sidecar).kv["pi2.bundle.align"])
    assert int(c_on.bytes_read.sum()) % align == 0  # whole bundles (multiples of the sidecar's alignment)
    assert int(c_on.bytes_read.sum()) >= int(c_off.bytes_read.sum())


LONG_PROMPT = PROMPT + " and its provinces, from the kings to the republic and the emperors who followed"


@pytest.mark.parametrize("which", ["relu", "smol"])
def test_prompt_batch_reads_each_layer_once(which: str, relu_model: tuple[Path, Path, list], smollm2: Path,
                                            smol_sidecar: Path) -> None:
    """On flash a prompt runs as one batch per layer (batch_ffn.h): the bundles of the neurons any of its tokens needs
    are requested once and each cluster serves every token, so a layer reads at most its bundles, once, in a cache
    far smaller than the FFN. In oracle and dense modes it computes every neuron's gate for every token and applies the
    mode's rule: for the ReLU model exactly the neurons that fire, for SmolLM2 (dense) all of them, so its logits are the
    token-by-token engine's in that mode up to float rounding (the down sums are grouped differently; each layer's
    GLU is the same bit for bit, its down output within 1e-6). Token by token in predicted mode, each token requests
    its own neurons and, where those differ, reads more."""
    model, sidecar = (relu_model[0], relu_model[1]) if which == "relu" else (smollm2, smol_sidecar)
    reference_mode = "oracle" if which == "relu" else "dense"
    sc = read_sidecar(sidecar)
    layer_bytes = np.array([sc.bundles(il).nbytes for il in range(sc.n_layer)])

    def prompt(mode: str, settings: dict[str, int]) -> tuple[np.ndarray, pi2_gguf.Counters, int]:
        llm = _load_small_cache(model, sidecar, mode, settings)
        toks = llm.tokenize(LONG_PROMPT.encode(), add_bos=True)
        pi2_gguf.reset_counters()
        llm.eval(toks)
        c = pi2_gguf.read_counters()
        row = last_logits(llm).copy()
        llm.close()
        return row, c, len(toks)

    _, c, n = prompt("predicted", {})
    _, alone, _ = prompt("predicted", FLASH_SAME_ENGINE)
    assert 4 < n <= 32  # a batch (past PI2_SPARSE_BATCH), within the budget's n_batch
    assert int(c.misses.sum()) > 0
    assert (c.bytes_read <= layer_bytes).all(), (c.bytes_read, layer_bytes)
    assert int(c.bytes_read.sum()) <= int(alone.bytes_read.sum())
    if which == "relu":  # each token's own neurons, requested token by token: bridged reads again and again
        assert int(c.bytes_read.sum()) < int(alone.bytes_read.sum()), (int(c.bytes_read.sum()), int(alone.bytes_read.sum()))
    # one batch (llama prunes the last layer to the last token): the gates of the neurons some token's predictor
    # chose, for every token; in the reference mode every neuron's
    n_ff = np.array(sc.kv["pi2.n_ff"][:-1])
    assert (c.sparse_tokens[:-1] == n).all() and (c.predicted[:-1] <= n * n_ff).all() and (c.predicted[:-1] % n == 0).all()
    got, c_ref, _ = prompt(reference_mode, {})
    assert (c_ref.predicted[:-1] == n * n_ff).all()
    want, _, _ = prompt(reference_mode, FLASH_SAME_ENGINE)
    assert np.argmax(got) == np.argmax(want)
    if which == "relu":  # (SmolLM2's outlier activations, ~500, carry its layers' 1e-6 differences to a few % of a logit)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()


def test_failed_prefetch_read_ends_generation_with_a_message(smollm2: Path, smol_sidecar: Path) -> None:
    llm = _load_small_cache(smollm2, smol_sidecar)
    assert llm.cache_info().n_prefetch > 0
    _steps(llm, 1)
    for after in range(0, 40, 3):  # some of these requests are prefetches: every fault must surface
        plugin.inject_read_fault(llm.pi2_binding, after, errno.EIO)
        with pytest.raises(SidecarError, match=r"read of \d+ bytes at offset \d+ failed.*Input/output error \(injected\)"):
            _steps(llm, 3)
    _steps(llm, 2)
    llm.close()


def test_reads_in_flight_cap_changes_nothing_but_timing(smollm2: Path, smol_sidecar: Path) -> None:
    """I/O threads take queued requests in order while less than PI2_IO_INFLIGHT_BYTES is being read: one
    request at a time (4 KiB), the default (2 MiB) and no cap (0) give the same logits and read the same."""
    runs = []
    for env in ({"PI2_IO_INFLIGHT_BYTES": "4096"}, None, {"PI2_IO_INFLIGHT_BYTES": "0"}):
        flash = _load_small_cache(smollm2, smol_sidecar, settings=env)
        pi2_gguf.reset_counters()
        logits = _steps(flash, 3)
        c = pi2_gguf.read_counters()
        flash.close()
        runs.append((logits, int(c.misses.sum()), int(c.bytes_read.sum())))
    assert runs[0][1] > 0
    for logits, misses, read in runs[1:]:
        assert np.array_equal(logits, runs[0][0])
        assert (misses, read) == runs[0][1:]


def _direct_io_takes(path: Path, align: int) -> bool:
    """Whether this file's filesystem takes an O_DIRECT read of align bytes at offset align."""
    buf = mmap.mmap(-1, 4096)  # page-aligned
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:  # no O_DIRECT at all (tmpfs)
            return False
        raise
    try:
        return os.preadv(fd, [memoryview(buf)[:align]], align) == align
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def relu512(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic ReLU model's sidecar with bundles padded to 512 bytes (convert --bundle-align 512)."""
    return convert(relu_model[0], tmp_path_factory.mktemp("relu512") / "relu512.pi2.gguf", train_tokens=2048,
                   heldout_tokens=512, progress=False, bundle_align=512, perplexity_budget=None).path


def test_bundles_aligned_to_512_bytes_on_flash(relu_model: tuple[Path, Path, list], relu512: Path) -> None:
    """Bundles padded to 512 bytes instead of 4 KiB read fewer bytes per miss, with O_DIRECT where the
    filesystem takes 512-byte offsets, and decode still equals the in-RAM decode."""
    model, sidecar = relu_model[0], relu512
    sc = read_sidecar(sidecar)
    sizes = {int(s) for s in sc.kv["pi2.bundle.size"]}
    ends = {sc.bundle_slices(il)[2].stop for il in range(sc.n_layer)}
    assert sizes == {-(-e // 512) * 512 for e in ends} and max(sizes) < fmt.BUNDLE_ALIGN
    want, got, c, info = _ram_then_flash(model, sidecar, sidecar)
    assert np.array_equal(got, want)
    assert info.direct_io == _direct_io_takes(sidecar, 512)
    assert (6 << 20) - max(sizes) < info.hot_bytes + info.cold_bytes <= 6 << 20
    misses, read = int(c.misses.sum()), int(c.bytes_read.sum())
    assert misses > 0 and read % 512 == 0 and read >= misses * min(sizes)


@pytest.fixture(scope="module")
def relu_packed(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic ReLU model's sidecar converted as relu512 but with 4 neurons to a bundle."""
    return convert(relu_model[0], tmp_path_factory.mktemp("relupacked") / "relu4.pi2.gguf", train_tokens=2048,
                   heldout_tokens=512, progress=False, bundle_align=512, bundle_neurons=4,
                   perplexity_budget=None).path


def test_bundles_of_several_neurons_decode_alike(relu_model: tuple[Path, Path, list], relu512: Path,
                                                relu_packed: Path) -> None:
    """4 neurons to a bundle: the same neuron bytes at other offsets, so in RAM and on flash the decode is
    the one-neuron sidecar's, bit for bit; flash reads whole bundles, so fewer, larger reads."""
    model = relu_model[0]
    sc = read_sidecar(relu_packed)
    assert [int(n) for n in sc.kv["pi2.bundle.neurons"]] == [4] * sc.n_layer
    size = {int(s) for s in sc.kv["pi2.bundle.size"]}
    assert len(size) == 1 and min(size) == -(-4 * sc.layout(0).stride // 512) * 512
    want, got, c, info = _ram_then_flash(model, relu512, relu_packed)
    assert np.array_equal(got, want)
    _, got1, c1, _ = _ram_then_flash(model, relu512, relu512)
    assert np.array_equal(got1, want)
    # the same neurons pass through the cache; each read holds whole bundles of 4
    assert int(c.hot_hits.sum() + c.cold_hits.sum() + c.misses.sum()) == int(c1.hot_hits.sum() + c1.cold_hits.sum() + c1.misses.sum())
    read = int(c.bytes_read.sum())
    assert read > 0 and read % min(size) == 0
    assert info.hot_neurons > 0 and info.hot_bytes % min(size) == 0


@pytest.fixture
def block_device_4k(tmp_path: Path):
    """A directory on an ext4 filesystem whose device has 4 KiB logical blocks (a loop device), where
    O_DIRECT refuses 512-byte offsets, as on UFS flash."""
    if os.geteuid() != 0 or shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root, losetup and mkfs.ext4")
    img, mnt = tmp_path / "4k.img", tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(96 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--sector-size", "4096", str(img)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-b", "4096", dev], check=True, capture_output=True)
        mnt.mkdir()
        subprocess.run(["mount", dev, str(mnt)], check=True, capture_output=True)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True, capture_output=True)


def test_512_byte_bundles_on_a_4k_block_device_read_buffered(relu_model: tuple[Path, Path, list], relu512: Path,
                                                             block_device_4k: Path) -> None:
    """Where O_DIRECT refuses the sidecar's 512-byte offsets, reads fall back to the page cache: the same
    tokens, nothing fails."""
    model = relu_model[0]
    sidecar = Path(shutil.copy(relu512, block_device_4k / relu512.name))
    assert not _direct_io_takes(sidecar, 512) and _direct_io_takes(sidecar, 4096)
    want, got, c, info = _ram_then_flash(model, relu512, sidecar)
    assert np.array_equal(got, want)
    assert not info.direct_io and int(c.misses.sum()) > 0


def _untied_copy(src: Path, dst: Path) -> Path:
    """src with its output matrix as a tensor of its own (a copy of token_embd), as most models have it."""
    return copy_gguf(src, dst, lambda name, data: [("output.weight", data)] if name == "token_embd.weight" else [])


def test_embedding_stays_in_the_model_file(relu_model: tuple[Path, Path, list], tmp_path: Path) -> None:
    """A token embedding is not loaded: PI2 reads its rows from the model file per token, and decoding stays
    bit-identical to the in-RAM run. Tied or not: a tied model's output matmul gets its own copy of the table
    from llama (ggml-cpu's buffer), so the GET_ROWS copy left in the file is the table's whole size of RAM
    given to the neuron cache."""
    model, sidecar, _ = relu_model
    untied = _untied_copy(model, tmp_path / "untied.gguf")
    ram = pi2_gguf.Llama(str(untied), sidecar=sidecar, n_ctx=256, n_threads=2, verbose=False,
                         settings=SAME_ENGINE)
    want = _steps(ram)
    ram.close()
    flash = _load_small_cache(untied, sidecar, settings=FLASH_SAME_ENGINE)
    info = flash.cache_info()
    got = _steps(flash)
    flash.close()
    embd = next(t for t in GGUFReader(untied).tensors if t.name == "token_embd.weight")
    assert info is not None and info.embedding_bytes == int(embd.n_bytes)
    assert np.array_equal(got, want)
    ram = pi2_gguf.Llama(str(model), sidecar=sidecar, n_ctx=256, n_threads=2, verbose=False, settings=SAME_ENGINE)
    want = _steps(ram)
    ram.close()
    tied = _load_small_cache(model, sidecar, settings=FLASH_SAME_ENGINE)
    info = tied.cache_info()
    got = _steps(tied)
    tied.close()
    embd = next(t for t in GGUFReader(model).tensors if t.name == "token_embd.weight")
    assert "output.weight" not in {t.name for t in GGUFReader(model).tensors}
    assert info is not None and info.embedding_bytes == int(embd.n_bytes)
    assert np.array_equal(got, want)


OUTPUT_ROWS = 16


def _rows_against_ram(model: Path, sidecar: Path, table: str) -> CacheInfo:
    """Greedy steps in RAM, then under a budget with PI2_OUTPUT_ROWS=16: the counters count 16 rows of `table` a token,
    the top rows equal the in-RAM logits (so greedy decoding follows the same tokens), the rest are the copy's, close
    to them. Returns the budget run's cache info."""
    ram = pi2_gguf.Llama(str(model), sidecar=sidecar, n_ctx=256, n_threads=2, verbose=False, settings=SAME_ENGINE)
    want = _steps(ram)
    ram.close()
    flash = _load_small_cache(model, sidecar, settings={"output_rows": OUTPUT_ROWS, **FLASH_SAME_ENGINE})
    pi2_gguf.reset_counters()
    got = _steps(flash)
    c = pi2_gguf.read_counters()
    info = flash.cache_info()
    flash.close()
    out = next(t for t in GGUFReader(model).tensors if t.name == table)
    row_bytes = int(out.n_bytes) // int(out.shape[1])
    # one output per eval: the prompt's last token, then each step's token (the last step's logits unread)
    assert c.output_rows == OUTPUT_ROWS * (len(got) + 1) and c.output_bytes == c.output_rows * row_bytes
    for w, g in zip(want, got):
        exact = np.abs(g - w) <= 1e-5 * np.abs(w).max()  # the copy's values are ~15% off: never this close
        assert np.argmax(g) == np.argmax(w) and exact[np.argmax(w)]
        assert exact.sum() >= OUTPUT_ROWS
        rel = np.linalg.norm(g[~exact] - w[~exact]) / np.linalg.norm(w[~exact])
        assert 0.0 < rel < 0.3, rel
    return info


def test_output_matrix_stays_in_the_model_file(relu_model: tuple[Path, Path, list], tmp_path: Path) -> None:
    """PI2_OUTPUT_ROWS=16: the output matrix is not kept; a Q3_K copy gives every logit and each token's 16
    largest are read from the model file and computed in its type. Those equal the in-RAM run's, so greedy
    decoding follows the same tokens; the rest are the copy's, close to them; the counters count the rows."""
    model, sidecar, _ = relu_model
    _rows_against_ram(_untied_copy(model, tmp_path / "untied.gguf"), sidecar, "output.weight")


def test_tied_embedding_output_rows(relu_model: tuple[Path, Path, list], relu_rows16: Path) -> None:
    """A tied embedding (no output.weight: llama multiplies by token_embd.weight, the table tensor itself once both
    uses are placed in PI2's flash buffer type) under PI2_OUTPUT_ROWS=16 is split as a separate output matrix is: a Q3_K
    copy gives every logit and each token's 16 largest are computed from the file's rows, equal to the in-RAM run's.
    The budget's floor counts the copy instead of the table; convert --output-rows stores the tied table's copy."""
    from pi2_gguf.runtime import native

    model, sidecar, _ = relu_model
    tensors = {t.name: t for t in GGUFReader(model).tensors}
    assert "output.weight" not in tensors
    embd = tensors["token_embd.weight"]
    info = _rows_against_ram(model, sidecar, "token_embd.weight")
    assert 0 < info.output_copy_bytes < int(embd.n_bytes) // 4  # F32 rows -> Q3_K
    without, with_rows = native.budget_floor(model, sidecar, 0), native.budget_floor(model, sidecar, OUTPUT_ROWS)
    assert without.non_ffn - with_rows.non_ffn == int(embd.n_bytes) - info.output_copy_bytes
    made = native.output_copy(model, True)
    assert made is not None and np.array_equal(_copy_rows(relu_rows16)[1], made[1])


def test_output_matrix_left_in_the_file_gives_its_ram_to_the_cache(relu_model: tuple[Path, Path, list],
                                                                  tmp_path: Path) -> None:
    """Under the same budget the neuron cache gets what the output matrix no longer takes, less its copy (up to
    the whole FFN: this model's 24 MiB of bundles are barely more than its output matrix)."""
    model, sidecar, _ = relu_model
    untied = _untied_copy(model, tmp_path / "untied.gguf")
    # the minimum of the load that holds the output matrix in RAM: the larger of the two (by about the matrix,
    # ~40 MB here), so both loads fit with room for a cache. The plugin's own minimum, measured twice, the larger:
    # it follows the process's resident memory, and late in a test session a load leaves a few MB behind (glibc
    # keeps freed small blocks), so one measure fell 2 MB short of the load after it (make test, 2026-11-26)
    budget = max(_load_minimum(untied, sidecar, {"output_rows": 0}) for _ in range(2)) + 40_000_000
    sc = read_sidecar(sidecar)
    all_bundles = sum(sc.layout(il).size * sc.layout(il).n_bundles(int(sc.kv["pi2.n_ff"][il])) for il in range(sc.n_layer))
    out = next(t for t in GGUFReader(untied).tensors if t.name == "output.weight")
    freed = int(out.n_bytes) - int(out.n_bytes) * 110 // 256 // 4  # F32 rows -> Q3_K (110 bytes per 256 values)
    sizes = []
    for rows in (0, OUTPUT_ROWS):
        llm = pi2_gguf.Llama(str(untied), sidecar=sidecar, memory_budget=budget, n_ctx=256, n_threads=2, verbose=False,
                             settings={"output_rows": rows})
        info = llm.cache_info()
        _steps(llm, 2)
        llm.close()
        sizes.append(info.hot_bytes + info.cold_bytes)
    assert sizes[1] >= min(sizes[0] + 0.8 * freed, all_bundles), (sizes, freed, all_bundles)
    # where the cache without it already held every bundle there is nothing more to give (the segments are sized
    # from the process's resident memory at load, which differs between the two loads by a few MB)
    assert sizes[1] > sizes[0] or sizes[0] >= all_bundles, (sizes, freed, all_bundles)


@pytest.fixture(scope="module")
def relu_rows16(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic ReLU model's sidecar recording 16 output rows and a Q2_K copy (convert --output-rows 16
    --output-copy q2_k)."""
    return convert(relu_model[0], tmp_path_factory.mktemp("rows16") / "rows16.pi2.gguf", train_tokens=2048,
                   heldout_tokens=512, progress=False, perplexity_budget=None, output_rows=OUTPUT_ROWS,
                   output_copy="q2_k").path


def test_output_rows_the_sidecar_records_apply_under_a_budget(relu_model: tuple[Path, Path, list], relu_rows16: Path,
                                                              tmp_path: Path) -> None:
    """convert --output-rows 16 --output-copy q2_k records pi2.budget.output_rows and pi2.budget.output_copy; under
    a budget the plugin then reads 16 exact rows a token and computes the rest from a Q2_K copy without being told,
    and the model's own settings (or PI2_OUTPUT_ROWS, PI2_OUTPUT_COPY) override them. In RAM they do nothing.
    Without --output-rows and without a perplexity check nothing is recorded."""
    model, sidecar, _ = relu_model
    kv = read_sidecar(relu_rows16).kv
    assert kv["pi2.budget.output_rows"] == OUTPUT_ROWS and kv["pi2.budget.output_copy"] == "q2_k"
    assert "pi2.budget.output_rows" not in read_sidecar(sidecar).kv
    assert "pi2.budget.output_copy" not in read_sidecar(sidecar).kv
    untied = _untied_copy(model, tmp_path / "untied.gguf")
    ram = pi2_gguf.Llama(str(untied), sidecar=relu_rows16, n_ctx=256, n_threads=2, verbose=False, settings=SAME_ENGINE)
    want = _steps(ram, 4)
    ram.close()
    counted, errors = [], []
    for settings in (None, {"output_copy": "q3_k"}, {"output_rows": 0}):
        flash = _load_small_cache(untied, relu_rows16, settings={**FLASH_SAME_ENGINE, **(settings or {})})
        pi2_gguf.reset_counters()
        got = _steps(flash, 4)
        counted.append(pi2_gguf.read_counters().output_rows)
        flash.close()
        inexact = [np.abs(g - w) > 1e-5 * np.abs(w).max() for g, w in zip(got, want)]
        errors.append(max(float(np.linalg.norm(g[m] - w[m]) / np.linalg.norm(w[m])) if m.any() else 0.0
                          for g, w, m in zip(got, want, inexact)))
    assert counted == [OUTPUT_ROWS * (len(got) + 1)] * 2 + [0]
    # the logits outside the exact rows: the recorded Q2_K copy's are coarser than Q3_K's; with the matrix in RAM
    # every logit is exact
    assert errors[0] > errors[1] > 0.0 and errors[2] == 0.0, errors
    ram = pi2_gguf.Llama(str(untied), sidecar=relu_rows16, n_ctx=256, n_threads=2, verbose=False)
    pi2_gguf.reset_counters()
    _steps(ram, 2)
    assert pi2_gguf.read_counters().output_rows == 0
    ram.close()


def test_malformed_recorded_output_rows_are_refused(relu_rows16: Path, tmp_path: Path) -> None:
    """pi2.budget.output_rows is PI2_OUTPUT_ROWS's value: out of its range, or not a u32, both readers refuse the
    sidecar naming the key; pi2.budget.output_copy likewise where PI2_OUTPUT_COPY would not take its value."""
    from pi2_gguf.runtime import native

    data = relu_rows16.read_bytes()
    key = b"pi2.budget.output_rows"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, OUTPUT_ROWS)  # GGUF type UINT32, the value
    for name, patch, why in (("big", struct.pack("<II", 4, 5000), "PI2_OUTPUT_ROWS=5000 is not"),
                             ("float", struct.pack("<If", 6, 16.0), "expected u32")):
        bad = tmp_path / f"{name}.pi2.gguf"
        bad.write_bytes(data[:at] + patch + data[at + 8:])
        with pytest.raises(SidecarError, match=f"pi2.budget.output_rows.*{why}"):
            read_sidecar(bad)
        with pytest.raises(SidecarError, match=f"pi2.budget.output_rows.*{why}"):
            native.validate_sidecar_c(bad)
    # pi2.budget.output_copy is PI2_OUTPUT_COPY's value: a type it does not take is refused by both
    key = b"pi2.budget.output_copy"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert data[at:at + 4 + 8 + 4] == struct.pack("<IQ", 8, 4) + b"q2_k"  # GGUF type STRING, its length, the value
    bad = tmp_path / "copy.pi2.gguf"
    bad.write_bytes(data[:at + 12] + b"q4_0" + data[at + 16:])
    with pytest.raises(SidecarError, match="pi2.budget.output_copy.*q4_0"):
        read_sidecar(bad)
    with pytest.raises(SidecarError, match="pi2.budget.output_copy.*q4_0"):
        native.validate_sidecar_c(bad)


@pytest.fixture(scope="module")
def untied_rows16(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the synthetic ReLU model with an output matrix of its own, its sidecar recording 16 output rows and a Q2_K
    copy): convert stores that copy in the sidecar (output.pi2_copy)."""
    d = tmp_path_factory.mktemp("copy")
    untied = _untied_copy(relu_model[0], d / "untied.gguf")
    sidecar = convert(untied, d / "untied.pi2.gguf", train_tokens=2048, heldout_tokens=512, progress=False,
                      perplexity_budget=None, output_rows=OUTPUT_ROWS, output_copy="q2_k").path
    return untied, sidecar


def _copy_rows(sidecar: Path) -> tuple[int, np.ndarray]:
    """(file offset, [n_vocab, row bytes] uint8) of a sidecar's output.pi2_copy."""
    t = next(t for t in GGUFReader(sidecar).tensors if t.name == fmt.OUTPUT_COPY_TENSOR)
    return int(t.data_offset), np.array(t.data)


def test_output_copy_in_the_sidecar_is_read_not_made(untied_rows16: tuple[Path, Path], tmp_path: Path) -> None:
    """convert stores the output matrix's Q2_K copy (output.pi2_copy), the bytes the plugin's load would make; a
    budget's load reads it: the logits equal those of the same sidecar without it (which makes the copy at load), a
    row changed in the sidecar shows in its logit (it was read, not made), and a changed row among those the load
    checks makes it quantize the matrix itself (the same logits as without the copy), as does PI2_OUTPUT_COPY asking
    for another type than the stored one."""
    from pi2_gguf.runtime import native

    model, sidecar = untied_rows16
    out = next(t for t in GGUFReader(model).tensors if t.name == "output.weight")
    n_vocab, n_embd = int(out.shape[1]), int(out.shape[0])
    at, rows = _copy_rows(sidecar)
    assert rows.shape == (n_vocab, fmt.row_size(GGMLQuantizationType.Q2_K, n_embd))
    made = native.output_copy(model, True)
    assert made is not None and made[0] == GGMLQuantizationType.Q2_K and np.array_equal(made[1], rows)
    q3 = native.output_copy(model, False)
    assert q3 is not None and q3[0] == GGMLQuantizationType.Q3_K
    without = copy_gguf(sidecar, tmp_path / "without.pi2.gguf", drop_tensors=[fmt.OUTPUT_COPY_TENSOR])
    assert fmt.OUTPUT_COPY_TENSOR not in read_sidecar(without).tensors
    # row 1 is not one the load checks (every n_vocab / 64th and the last); row 0 is
    assert n_vocab // 64 > 1
    data = bytearray(sidecar.read_bytes())
    changed = tmp_path / "changed.pi2.gguf"
    row = rows.shape[1]
    data[at + row:at + 2 * row] = bytes(row)  # row 1's scales and quants all zero: its logit 0 from the copy
    changed.write_bytes(bytes(data))
    checked = tmp_path / "checked.pi2.gguf"
    data = bytearray(sidecar.read_bytes())
    data[at:at + row] = bytes(row)
    checked.write_bytes(bytes(data))
    logits = {}
    for name, sc in (("with", sidecar), ("without", without), ("changed", changed), ("checked", checked)):
        flash = _load_small_cache(model, sc, settings=FLASH_SAME_ENGINE)
        logits[name] = _steps(flash, 4)
        flash.close()
    for name, sc in (("with q3_k", sidecar), ("without q3_k", without)):  # PI2_OUTPUT_COPY asks another type
        flash = _load_small_cache(model, sc, settings={**FLASH_SAME_ENGINE, "output_copy": "q3_k"})
        logits[name] = _steps(flash, 4)
        flash.close()
    assert np.array_equal(logits["with"], logits["without"])
    assert np.array_equal(logits["checked"], logits["without"])
    assert np.array_equal(logits["with q3_k"], logits["without q3_k"])
    assert not np.array_equal(logits["with q3_k"], logits["with"])
    differs = logits["changed"] != logits["with"]
    assert differs[:, 1].all() and np.all(logits["changed"][:, 1] == 0.0) and not differs[:, 2:].any()


def test_output_copy_of_another_matrix_is_refused(untied_rows16: tuple[Path, Path], tmp_path: Path) -> None:
    """An output.pi2_copy whose rows are not the model's output matrix's is refused at load, naming both; one of
    another type or width by both sidecar readers."""
    from pi2_gguf.runtime import native

    model, sidecar = untied_rows16
    copy = fmt.OUTPUT_COPY_TENSOR
    short = copy_gguf(sidecar, tmp_path / "short.pi2.gguf", drop_tensors=[copy],
                      extra=lambda name, data: [(name, data[:-1])] if name == copy else [])
    with pytest.raises(SidecarError, match=f"{copy} has \\d+ rows; the model's output.weight has \\d+"):
        _load_small_cache(model, short)
    for what, more in (("F16", lambda d: np.zeros((d.shape[0], 256), np.float16)),
                       ("Q2_K \\[512", lambda d: np.concatenate([d, d], axis=1))):
        bad = copy_gguf(sidecar, tmp_path / "bad.pi2.gguf", drop_tensors=[copy],
                        extra=lambda name, data: [(name, more(data))] if name == copy else [])
        with pytest.raises(SidecarError, match=f"tensor {copy} is {what}"):
            read_sidecar(bad)
        with pytest.raises(SidecarError, match=f"(?i)tensor {copy} (is F16|has shape \\(512)"):
            native.validate_sidecar_c(bad)


def test_embedding_file_changed_while_running_ends_generation(relu_model: tuple[Path, Path, list],
                                                             tmp_path: Path) -> None:
    model, sidecar, _ = relu_model
    untied = _untied_copy(model, tmp_path / "untied.gguf")
    llm = _load_small_cache(untied, sidecar)
    _steps(llm, 2)
    os.utime(untied, ns=(0, 0))  # as if rewritten in place: another model's rows could be read
    with pytest.raises(SidecarError, match="untied.gguf changed on disk while the model was running"):
        _steps(llm, 2)
    llm.close()


def test_budget_too_small_states_the_minimum(relu_model: tuple[Path, Path, list]) -> None:
    model, sidecar, _ = relu_model
    with pytest.raises(MemoryBudgetError, match=r"memory budget 50 MB is too small .* needs (at least|more than) \d+ MB"):
        pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="50MB", n_ctx=256, verbose=False)


def test_budget_needs_a_sidecar(smollm2: Path) -> None:
    with pytest.raises(MemoryBudgetError, match="needs the model's sidecar"):
        pi2_gguf.Llama(str(smollm2), sidecar=False, memory_budget="2GB", verbose=False)


def test_read_error_ends_generation_with_a_message(relu_model: tuple[Path, Path, list]) -> None:
    model, sidecar, _ = relu_model
    llm = _load_small_cache(model, sidecar)
    _steps(llm, 2)
    plugin.inject_read_fault(llm.pi2_binding, 1, errno.EIO)  # the second read from now fails
    with pytest.raises(SidecarError, match=r"read of \d+ bytes at offset \d+ failed.*Input/output error \(injected\)"):
        _steps(llm, 8)
    _steps(llm, 2)  # the fault was one read: the next generation reads again and works
    llm.close()


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_sidecar_changed_while_running_ends_generation(relu_model: tuple[Path, Path, list], tmp_path: Path,
                                                       change: str) -> None:
    model, sidecar, _ = relu_model
    copy = tmp_path / "relu.pi2.gguf"
    shutil.copyfile(sidecar, copy)
    llm = _load_small_cache(model, copy)
    _steps(llm, 2)
    if change == "truncated":
        os.truncate(copy, copy.stat().st_size // 2)
    else:  # same size, other bytes: a careless copy over the file
        with open(copy, "r+b") as f:
            f.seek(copy.stat().st_size - 8192)
            f.write(os.urandom(4096))
    with pytest.raises(SidecarError, match="changed on disk while the model was running"):
        _steps(llm, 4)
    llm.close()
    assert sidecar.stat().st_size > copy.stat().st_size or change == "rewritten"


def test_env_budget_for_other_frontends(relu_model: tuple[Path, Path, list]) -> None:
    """PI2_SIDECAR + PI2_MEMORY_BUDGET with plain llama_cpp.Llama (use_mmap off): the plugin sizes the
    cache itself at the first compute, and decodes as in RAM."""
    model, sidecar, _ = relu_model
    ram = pi2_gguf.Llama(str(model), sidecar=sidecar, n_ctx=256, n_threads=2, verbose=False,
                         settings=SAME_ENGINE)
    want = [int(np.argmax(r)) for r in _steps(ram, 8)]
    ram.close()
    code = (
        "import sys, json, numpy as np, llama_cpp, pi2_gguf\n"
        "from pi2_gguf.runtime.generate import last_logits\n"
        "pi2_gguf.register(); pi2_gguf.configure('sparse_batch', 64); pi2_gguf.configure('down_sparse_max', 1.0)\n"
        f"llm = llama_cpp.Llama({str(model)!r}, use_mmap=False, n_ctx=256, n_threads=2, n_batch=32, verbose=False)\n"
        f"llm.eval(llm.tokenize({PROMPT!r}.encode(), add_bos=True)); out = []\n"
        "for _ in range(8):\n"
        "    out.append(int(np.argmax(last_logits(llm)))); llm.eval([out[-1]])\n"
        "c = pi2_gguf.read_counters(); print(json.dumps([out, int(c.misses.sum() + c.hot_hits.sum())]))\n")
    env = dict(os.environ, PI2_SIDECAR=str(sidecar), PI2_MEMORY_BUDGET="4GB")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    got, found = __import__("json").loads(res.stdout.strip().splitlines()[-1])
    assert got == want
    assert found > 0  # bundles came through the cache


@pytest.mark.skipif(cgroup.available() is not None, reason=str(cgroup.available()))
def test_peak_memory_stays_within_the_budget_in_a_cgroup(relu_model: tuple[Path, Path, list]) -> None:
    """A cgroup v1 limit equal to the budget, cold page cache: the run completes without an OOM kill,
    the group's peak stays within the budget, and the tokens equal the in-RAM sparse decode's."""
    model, sidecar, _ = relu_model
    budget = _minimum(model, sidecar) + 40_000_000
    cmd = greedy_command(model, [PROMPT], N_STEPS, pi2=True, sidecar=sidecar, logits=False, memory_budget=budget)
    env = dict(os.environ, PI2_SPARSE_BATCH="64", PI2_DOWN_SPARSE_MAX="1")
    flash_env = dict(env, PI2_CACHE_MAX=str(6 << 20))  # most bundles on flash
    ram_env = subprocess.run(greedy_command(model, [PROMPT], N_STEPS, pi2=True, sidecar=sidecar, logits=False),
                             capture_output=True, text=True, check=True, timeout=300, env=env)
    r = cgroup.run(cmd, budget, [model, sidecar], timeout=300, env=flash_env)
    assert r.returncode == 0 and r.oom_kills == 0, r.stderr[-2000:]
    assert r.peak_bytes <= budget
    got = parse_results(r.stdout)[0]
    assert got.tokens == parse_results(ram_env.stdout)[0].tokens
    assert len(got.tokens) == N_STEPS and got.io["misses"] > 0


def test_budget_is_spent_on_the_cache_not_left_idle(smollm2: Path, smol_sidecar: Path) -> None:
    """In a fresh process given 120 MB more than it holds: after a 40-token prompt and 16 tokens, its peak
    resident memory sits between budget - 1.5 margins (the neuron cache got what llama and the process do
    not touch: compute buffers are reserved as far as llama uses them, e.g. not the n_batch - 1 rows of
    logits llama-cpp-python never asks for) and budget - half the margin (the plan holds). The bundles: this
    budget would hold some layers whole (PI2_DENSE_READS=auto). (With 150 MB more the cache holds every bundle,
    since the sidecar's output rows keep a 16 MB copy of the tied table in RAM instead of the 30 MB table, and the
    rest of the budget stays idle, as it should.)"""
    code = (
        "import json, re, sys, pi2_gguf\n"
        "from pi2_gguf.runtime.generate import last_logits\n"
        f"BUNDLES = {BUNDLES!r}\n"
        "def status(k):\n"
        "    return int(re.search(k + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
        "budget = status('VmRSS') + 120_000_000\n"
        "llm = pi2_gguf.Llama(sys.argv[1], sidecar=sys.argv[2], memory_budget=budget, n_ctx=256, n_threads=2,\n"
        "                     verbose=False, settings=BUNDLES)\n"
        f"llm.eval(llm.tokenize((({PROMPT!r} + ' ') * 8).encode(), add_bos=True)[:40])\n"
        "for _ in range(16):\n"
        "    llm.eval([int(last_logits(llm).argmax())])\n"
        "ci = llm.cache_info()\n"
        "print(json.dumps([budget, status('VmHWM'), ci.hot_bytes + ci.cold_bytes]))\n")
    r = subprocess.run([sys.executable, "-c", code, str(smollm2), str(smol_sidecar)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    budget, peak, cache = json.loads(r.stdout.strip().splitlines()[-1])
    margin = model_stats.BUDGET_MARGIN  # PI2_BUDGET_MARGIN
    assert budget - 1.5 * margin <= peak <= budget - margin / 2, (budget, peak, cache)
    assert cache > 0


@pytest.mark.skipif(cgroup.available() is not None, reason=str(cgroup.available()))
def test_bench_rounds_in_turn_under_the_limit(relu_model: tuple[Path, Path, list], monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """`pi2-gguf bench --rounds 2 --json`: every configuration twice in turn under the limit, medians of the
    rounds, pi2 reading bundles from flash within the limit, and the table's per-round ratio ranges."""
    from pi2_gguf.bench.memory_limit import Row, format_table
    from pi2_gguf.cli import main
    from pi2_gguf.runtime.isolated import _disk_busy_ms

    model, sidecar, _ = relu_model
    limit = _minimum(model, sidecar) + 40_000_000
    monkeypatch.setenv("PI2_CACHE_MAX", str(6 << 20))  # the configurations' processes inherit it: most bundles on flash
    out = tmp_path / "bench.json"
    with out.open("w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        assert main(["bench", str(model), "--memory-limit", str(limit), "--sidecar", str(sidecar), "-n", "4",
                     "--rounds", "2", "--json"]) == 0
    monkeypatch.undo()
    rows = json.loads(out.read_text())["rows"]
    by_name = {r["name"].split(",")[0] if r["name"].startswith("pi2") else r["name"]: r for r in rows}
    assert len(rows) == 4
    stock = by_name["stock llama.cpp, mmap, repack off"]
    pi2 = next(r for r in rows if r["name"].startswith("pi2, memory budget"))
    ram = next(r for r in rows if r["name"].startswith("pi2, all in RAM"))
    for r in (stock, pi2, ram):
        assert r["status"] == "ok" and len(r["rounds"]) == 2
        assert r["decode_tps"] == pytest.approx(float(np.median([x["decode_tps"] for x in r["rounds"]])))
        assert all(x["decoded"] == 4 for x in r["rounds"])
    for r in rows:
        if r["limited"]:
            assert r["peak_mb"] * 1e6 <= limit and all(x["peak_mb"] * 1e6 <= limit for x in r["rounds"])
    assert pi2["read_per_token_mb"] > 0 and 0 < pi2["cache_hit_rate"] < 1
    # the cache's segments fit the limit (with the model's other weights) and the in-RAM run has none
    assert pi2["hot_mb"] > 0 and pi2["cold_mb"] > 0 and (pi2["hot_mb"] + pi2["cold_mb"]) * 1e6 < limit
    assert ram["hot_mb"] == ram["cold_mb"] == 0
    # the disk's busy share over decode: the budgeted row reads its misses from the sidecar's device (cold cache)
    if _disk_busy_ms(sidecar) is not None:
        assert 0 <= pi2["disk_busy_share"] <= 1
    else:  # not on a block device here: the column says so
        assert pi2["disk_busy_share"] == -1

    def row(d: dict) -> Row:
        return Row(**{**d, "rounds": [Row(**x) for x in d["rounds"]]})

    table = format_table(model, limit, None, [row(r) for r in rows])
    assert "2 rounds in turn" in table
    assert re.search(r"\| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\dx\) \|", table), table
    assert f"| {pi2['hot_mb']:.0f} + {pi2['cold_mb']:.0f} |" in table


def test_budget_use_states_every_item_and_adds_up(smollm2: Path, smol_sidecar: Path) -> None:
    """Where a budget went, item by item (runtime, llama.cpp's weights in RAM and KV cache from llama.cpp's own
    report, predictors, compute buffers, tables, margin): under a tight budget the caches got the rest (to the
    plan's rounding, 1 MB); under a loose one every bundle is cached and the line says how much went unused. The
    bundles: both budgets would hold every layer whole (PI2_DENSE_READS=auto)."""
    code = (
        "import json, re, sys, pi2_gguf\n"
        "from pi2_gguf.runtime.llama_memory import llama_memory\n"
        f"BUNDLES = {BUNDLES!r}\n"
        "def rss():\n"
        "    return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
        "budget = rss() + int(sys.argv[3])\n"
        "llm = pi2_gguf.Llama(sys.argv[1], sidecar=sys.argv[2], memory_budget=budget, n_ctx=256, n_threads=2,\n"
        "                     verbose=False, settings=BUNDLES)\n"
        "use, ci = llm.budget_use(), llm.cache_info()\n"
        "mem = llama_memory(llm._ctx.ctx)\n"
        "print(json.dumps([budget, use.to_json(), use.unused, use.line(), ci.fixed_bytes, mem.context,\n"
        "                  [b.buffer_type for b in mem.buffers]]))\n")

    def run(above_rss: int) -> tuple[int, dict, int, str, int, int, list[str]]:
        r = subprocess.run([sys.executable, "-c", code, str(smollm2), str(smol_sidecar), str(above_rss)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(json.loads(r.stdout.strip().splitlines()[-1]))  # type: ignore[return-value]

    loose = run(400_000_000)
    assert loose[2] > 50_000_000 and "unused (every bundle cached, or less than" in loose[3], loose  # SmolLM2's: ~110 MB
    budget, use, unused, line, predictors, kv, bufts = run(150_000_000)
    items = dict(use["items"])
    assert use["budget"] == budget and unused < 1_000_000, (use, unused)
    assert abs(sum(items.values()) + use["cache"] - budget) <= 1_000_000, (items, use)
    assert items["margin"] == model_stats.BUDGET_MARGIN
    assert items["predictors"] == predictors and items["KV cache"] == kv > 0
    assert "PI2" in bufts and "CPU" in bufts  # PI2's flash buffers hold no weights: not counted as weights in RAM
    # SmolLM2's non-FFN weights in RAM: attention and norms, ~20 MB in Q4_1; the token embedding stays in the file
    assert 5_000_000 < items["llama.cpp's weights in RAM"] < 60_000_000, items
    assert items["runtime (Python, libraries, heap)"] > 20_000_000 and items["compute buffers"] > 0, items
    assert line.startswith(f"budget {budget / 1e6:.0f} MB: runtime") and "the caches got" in line


@pytest.fixture(scope="module")
def smol_whole(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 (SiLU) converted with --dense-reads model (no perplexity measure): every FFN layer read whole."""
    return convert(smollm2, tmp_path_factory.mktemp("whole") / "smol.pi2.gguf", perplexity_budget=None,
                   dense_reads="model", progress=False).path


def _ffn_spans(model: Path) -> list[int]:
    """Per layer, the bytes a whole read of its ffn_gate, up and down takes: each range widened to 4 KiB blocks."""
    r = GGUFReader(model)
    spans: dict[int, int] = {}
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            lo = t.data_offset // 4096 * 4096
            hi = -(-(t.data_offset + int(t.n_bytes)) // 4096) * 4096
            spans[int(parts[1])] = spans.get(int(parts[1]), 0) + hi - lo
    return [spans[il] for il in sorted(spans)]


def test_dense_layers_read_whole_from_the_model_file(smollm2: Path, smol_whole: Path) -> None:
    """pi2.dense_reads = model (convert --dense-reads model): the sidecar holds no copy of the FFN (under 1% of
    the model), decoding gives stock's tokens in RAM and under a budget; a cache of every layer reads nothing once
    the prompt has read it, one of 5 layers pins 2 and streams the other 28 through 3 entries (each a whole read a
    token, the next two read while one computes), one of 3 layers pins 1 and streams through 2, and one of a single
    layer streams them all."""
    from pi2_gguf.runtime.isolated import greedy_in_subprocess

    sc = read_sidecar(smol_whole)
    assert sc.kv[fmt.Key.DENSE_READS] == "model" and sc.whole_layers == frozenset(range(sc.n_layer))
    assert not sc.tensors and smol_whole.stat().st_size < 0.01 * smollm2.stat().st_size
    assert sc.kv[fmt.Key.CALIB_TOKENS] == 0  # nothing profiled
    stock = greedy_in_subprocess(smollm2, [PROMPT], N_STEPS, pi2=False, repack=False)[0]
    ram = greedy_in_subprocess(smollm2, [PROMPT], N_STEPS, pi2=True, sidecar=smol_whole, mode="predicted")[0]
    assert ram.tokens == stock.tokens
    spans = _ffn_spans(smollm2)
    entry = max(spans)
    evals = N_STEPS - 1  # the prompt's batch computes the first token
    for entries, pinned in ((len(spans), len(spans)), (5, 2), (3, 1), (1, 0)):
        flash = greedy_in_subprocess(smollm2, [PROMPT], N_STEPS, pi2=True, sidecar=smol_whole, mode="predicted",
                                     memory_budget=2 << 30, settings={"cache_max": entries * entry})[0]
        assert flash.tokens == stock.tokens, entries
        streamed = len(spans) - pinned
        read = flash.io["bundle_bytes"]
        # every layer streamed is read once a token (a layer's span is at most an entry)
        assert evals * streamed * min(spans) <= read <= evals * streamed * entry, (entries, read, flash.io)
        assert flash.io["cold_hits"] == evals * pinned, (entries, flash.io)


@pytest.fixture(scope="module")
def smol_q40_first10(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 converted with its first 10 layers' bundle rows in Q4_0 (--bundle-type q4_0 --bundle-type-layers 0-9):
    layers that compute from their bundles in RAM too, which a budget does not read whole."""
    return convert(smollm2, tmp_path_factory.mktemp("q40first") / "smol.pi2.gguf", sparsity=SMOL_TARGET, ranks=[64],
                   perplexity_budget=None, bundle_type="q4_0", bundle_type_layers="0-9", train_tokens=512,
                   heldout_tokens=256, progress=False).path


def test_dense_layers_that_fit_are_read_whole(smollm2: Path, smol_sidecar: Path, smol_q40_first10: Path) -> None:
    """PI2_DENSE_READS=auto (the default): SmolLM2's bundles sidecar, none of whose layers sparse decode is expected to
    run faster than ggml-cpu (in RAM all 30 run there). Under a budget whose cache holds every FFN layer whole the
    layers come whole from the model file (each an entry of the layer cache, found every token; no bundle cached or
    read) and compute as in RAM, so decode gives stock's tokens. A cache where the bundles alone do not all fit, or
    PI2_DENSE_READS=bundles, reads none whole. Layers whose bundles hold other row types than the model's (convert
    --bundle-type) keep their bundles, all hot, beside the others read whole: a token reads nothing."""
    from pi2_gguf.runtime.isolated import greedy_in_subprocess

    spans = _ffn_spans(smollm2)
    entry = max(spans)
    evals = N_STEPS - 1  # the prompt's batch computes the first token
    stock = greedy_in_subprocess(smollm2, [PROMPT], N_STEPS, pi2=False, repack=False)[0]
    bundles_bytes = sum(read_sidecar(smol_sidecar).bundles(il).nbytes for il in range(len(spans)))

    def flash(settings: dict[str, str | int], sidecar: Path = smol_sidecar) -> Any:
        return greedy_in_subprocess(smollm2, [PROMPT], N_STEPS, pi2=True, sidecar=sidecar, mode="predicted",
                                    memory_budget=2 << 30, settings=settings)[0]

    for settings in ({}, {"cache_max": len(spans) * entry}):
        whole = flash(settings)
        assert whole.tokens == stock.tokens, settings
        assert whole.io["expert_bytes"] == len(spans) * entry and whole.io["hot_bytes"] == whole.io["cold_bytes"] == 0
        assert whole.io["cold_hits"] == evals * len(spans) and whole.io["hot_hits"] == whole.io["misses"] == 0
        assert whole.io["bundle_bytes"] == 0, whole.io  # every layer read by the prompt, none again
    for settings in ({"cache_max": bundles_bytes // 2}, BUNDLES):
        bundles = flash(settings)
        assert bundles.io["expert_bytes"] == 0 and bundles.io["hot_bytes"] + bundles.io["cold_bytes"] > 0, settings
        assert bundles.io["hot_hits"] + bundles.io["cold_hits"] + bundles.io["misses"] > evals * len(spans), settings
    mixed = flash({}, smol_q40_first10)
    q40 = read_sidecar(smol_q40_first10)
    assert mixed.io["expert_bytes"] == 20 * max(spans[10:]), mixed.io  # layers 10-29, an entry each
    assert mixed.io["hot_bytes"] == sum(q40.bundles(il).nbytes for il in range(10)), mixed.io  # layers 0-9, all hot
    assert mixed.io["cold_hits"] == evals * 20 and mixed.io["misses"] == mixed.io["bundle_bytes"] == 0, mixed.io


def test_run_verbose_states_the_layer_cache(smollm2: Path, smol_whole: Path) -> None:
    """`pi2-gguf run -v` under a budget with layers read whole from the model file: how many layers the cache holds,
    and whether the others stream (python -m: the source tree's CLI)."""
    entry = max(_ffn_spans(smollm2))

    def run(entries: int) -> str:
        res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "run", str(smollm2), "--sidecar", str(smol_whole),
                              "--memory-budget", "1GB", "-p", PROMPT, "-n", "4", "-c", "256", "-v"],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PI2_CACHE_MAX": str(entries * entry)})
        assert res.returncode == 0, res.stderr[-2000:]
        return next(line for line in res.stdout.splitlines() if line.startswith("layer cache"))

    assert "(5 FFN layers read whole from the model file of 30: most pinned, the others streamed" in run(5)
    assert "(30 FFN layers read whole from the model file: every layer at once)" in run(30)
