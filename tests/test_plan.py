"""`pi2-gguf plan` (pi2_gguf/planner): the request chances, the cache plan (against a direct port of the plugin's
loop), the cold segment's horizon, gap bridging, the prediction's monotonicity in the budget, the recommendation and
its refusals, and the device measurement's cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
import sidecar_factory as factory  # noqa: E402

from pi2_gguf.errors import MemoryBudgetError, Pi2Error  # noqa: E402
from pi2_gguf.planner import device as device_mod  # noqa: E402
from pi2_gguf.planner import predict as pr  # noqa: E402
from pi2_gguf.planner.device import DeviceProfile, ReadPoint  # noqa: E402
from pi2_gguf.planner.model_stats import ModelStats, layer_stats, want_probabilities  # noqa: E402
from pi2_gguf.planner.report import command, recommend  # noqa: E402
from pi2_gguf.sidecar.reader import read  # noqa: E402

MB = 1_000_000


def _stats(tmp_path: Path, n_ff: tuple[int, ...] = (96, 128, 160), neurons: int = 1) -> ModelStats:
    """A factory sidecar's statistics (three F16 layers; predictors paying or not as their sizes say), with a
    fixed 100 MB for everything but the neuron cache."""
    sc = factory.build(n_embd=64, n_ff=n_ff, rank=(8,) * len(n_ff), bundle_neurons=neurons)
    path = factory.write(sc, tmp_path / "f.pi2.gguf")
    layers = layer_stats(read(path), cost=[0.6] * len(n_ff))
    return ModelStats(tmp_path / "f.gguf", path, layers, {"Q4_0": 10 * MB}, {"Q4_0": 12 * MB},
                      {"process": 60 * MB, "non-FFN weights": 40 * MB}, 128, 400 * MB, relu_family=False)


def _device() -> DeviceProfile:
    """A disk of 1 GB/s with 50 us a request in flight, 100 us alone; 10 GB/s of dot products a core."""
    reads = {}
    for size in (4096, 65536, 1 << 20):
        t = 50e-6 + size / 1e9
        reads[str(size)] = ReadPoint(size, 100e-6 + size / 1e9, size / t, True)
    return DeviceProfile("k", {"cpu": "test"}, reads, {"Q4_0@1": 10e9, "Q4_0@2": 18e9, "F16@1": 10e9,
                                                        "F16@2": 18e9, "Q8_0@1": 10e9, "Q8_0@2": 18e9})


def test_want_probabilities() -> None:
    freq = np.array([0.9, 0.5, 0.2, 0.1, 0.0, 0.0])
    assert np.array_equal(want_probabilities(freq, 2, 0.3, 0.4, predictor_runs=False), np.ones(3))
    q = want_probabilities(freq, 1, 0.28, 0.5, predictor_runs=True)
    assert q.sum() == pytest.approx(0.5 * 6, rel=1e-6)  # the predictor's density
    assert np.all(np.diff(q) <= 1e-12) and q.max() <= 1.0 and q[-1] == 0.0
    pairs = want_probabilities(freq, 2, 0.28, 0.5, predictor_runs=True)
    assert pairs == pytest.approx([1 - (1 - q[0]) * (1 - q[1]), 1 - (1 - q[2]) * (1 - q[3]), 0.0])
    # neurons past n_ff in the last bundle are padding: never requested
    odd = want_probabilities(freq[:5], 2, 0.28, 0.5, predictor_runs=True)
    assert odd.size == 3 and odd[2] == pytest.approx(want_probabilities(freq[:5], 1, 0.28, 0.5, True)[4])


def _plan_reference(stats: ModelStats, cache_bytes: int) -> tuple[list[int], int]:
    """pi2_cache_plan's loop, line for line (flash/memory_budget.c), without prefetch and cold share."""
    items = sorted(((-float(L.freq[j]), il, j) for il, L in enumerate(stats.layers) for j in range(L.n_bundles)))
    hot = [0] * len(stats.layers)
    used = best_used = 0
    best = 0
    for k, (_, il, _j) in enumerate(items):
        used += stats.layers[il].bundle_size
        if used > cache_bytes:
            break
        hot[il] += 1
        need = max(L.n_bundles - h for L, h in zip(stats.layers, hot))
        if (cache_bytes - used) // stats.entry >= need:
            best, best_used = k + 1, used
    out = [0] * len(stats.layers)
    for _, il, _j in items[:best]:
        out[il] += 1
    return out, best_used


def test_cache_plan_matches_the_plugin_loop(tmp_path: Path) -> None:
    stats = _stats(tmp_path)
    assert stats.prefetch_entries_wanted == 0 or any(not L.predictor_runs for L in stats.layers)
    for L in stats.layers:
        L.predictor_runs = True  # no prefetch room: the reference has none
    total = stats.bundle_bytes
    seen = set()
    for cache in range(stats.min_cache, total + 2 * stats.min_cache, stats.entry // 2 or 1):
        plan = pr.cache_plan(stats, cache)
        ref_hot, ref_used = _plan_reference(stats, cache)
        assert plan.hot_k == ref_hot, cache
        assert plan.hot_bytes == ref_used
        seen.add(sum(plan.hot_k))
    assert min(seen) == 0 and max(seen) == sum(L.n_bundles for L in stats.layers)  # from nothing hot to all of it


def test_cold_horizon() -> None:
    ones = np.ones(100)
    assert pr.cold_horizon(ones, 99) == 0           # a token's misses sweep through a smaller segment
    assert pr.cold_horizon(ones, 100, limit=77) == 77  # all of them fit
    half = np.full(100, 0.5)
    # distinct requests in t tokens: 100 (1 - 0.5^t): 50, 75, 87.5, 93.75
    assert pr.cold_horizon(half, 80) == 2
    assert pr.cold_horizon(half, 93) == 3
    assert pr.cold_horizon(np.zeros(10), 0) == 4096


def test_reads_bridge_gaps_and_split() -> None:
    miss = np.zeros((2, 40), dtype=bool)
    miss[0, [0, 5, 20]] = True  # 4 bundles between 0 and 5 (bridged: 4 x 4096 <= 32768), 14 before 20 (not)
    b, r, v, any_ = pr._reads(miss, 4096)
    # iovecs: three entries and the bridged gap's scratch
    assert (b, r, v, any_) == ((6 + 1) * 4096 / 2, 2 / 2, 4 / 2, 0.5)
    miss[1, :] = True  # one run of 40 bundles split at 16 (64 KiB of 4 KiB bundles with max 65536)
    b, r, v, _ = pr._reads(miss, 4096, max_bytes=65536)
    # the run's 40 entries come from the CLOCK hand in a row: one iovec, unless it steps over referenced entries
    assert r == (2 + 3) / 2 and b == (7 + 40) * 4096 / 2 and v == (4 + 1) / 2
    assert pr._reads(miss, 4096, max_bytes=65536, referenced=0.5)[2] == (4 + 1 + 39 * 0.5) / 2


@pytest.mark.parametrize("neurons", [1, 4])
def test_prediction_monotone_in_the_budget(tmp_path: Path, neurons: int) -> None:
    stats = _stats(tmp_path, neurons=neurons)
    dev = _device()
    budgets = pr.budget_steps(stats, 12)
    assert budgets[0] >= stats.min_budget and budgets[-1] >= stats.all_hot_budget()
    preds = [pr.predict(stats, dev, b) for b in budgets]
    for a, b in zip(preds, preds[1:]):
        assert b.read_bytes <= a.read_bytes + 1e-9
        assert b.token_s <= a.token_s + 1e-12
        assert b.hit_rate >= a.hit_rate - 1e-12
    assert preds[0].read_bytes > stats.read_extra  # the minimum reads bundles ...
    assert preds[-1].read_bytes == stats.read_extra and preds[-1].hit_rate == 1.0  # ... every bundle hot reads none
    assert preds[-1].io_s == 0.0
    # all hot: the FFN's compute at 18 GB/s x 1.2 (the repacked GEMV's gain) for the plugin's cost 0.6, computed from
    # cache entries (FLASH_COMPUTE_FACTOR), the predictors where they run, and the other weights (10 MB of Q4_0)
    rate = 18e9 * pr.REPACK_GAIN
    want = (sum(L.dense_bytes * 0.6 * pr.FLASH_COMPUTE_FACTOR + L.predictor_bytes for L in stats.layers) + 10 * MB) / rate
    assert preds[-1].token_s == pytest.approx(want + pr.TOKEN_OVERHEAD_S + 3 * pr.LAYER_OVERHEAD_S)


def test_layers_read_whole_are_planned_without_their_bundles(tmp_path: Path) -> None:
    """Where the plugin reads a layer whole from the model file (PI2_DENSE_READS=auto), the prediction neither caches
    nor reads its bundles, computes its model weights at the plugin's dense rate, and plans the neuron cache over the
    other layers (pi2_cache_plan's skip: no prefetch room); the table runs up to the budget where every such layer is
    read whole, and past the all-hot budget such a budget decodes faster."""
    stats = _stats(tmp_path)
    dev = _device()
    for L in stats.layers:
        L.model_weights = (("Q4_0", L.dense_bytes // 4),) * 3
    entry = max(L.dense_bytes for L in stats.layers)  # one entry size for every layer read whole (the largest)
    whole_all = entry * 2  # layers 0 and 2 may be read whole (say their cost is >= 1); layer 1 keeps its bundles
    rest = stats.layers[1].n_bundles * stats.layers[1].bundle_size
    top = stats.fixed_bytes + whole_all + rest

    def rule(cache: int) -> tuple[tuple[bool, ...], int]:  # the plugin's rule for these sizes, smallest layer first
        if cache >= whole_all + rest:
            return (True, False, True), whole_all
        return (False, False, False), 0
    for cache in {*(b - stats.fixed_bytes for b in pr.budget_steps(stats, 12)), 1 << 62, top - stats.fixed_bytes,
                  max(stats.min_budget - stats.fixed_bytes, stats.min_cache), stats.all_hot_budget() - stats.fixed_bytes}:
        stats._whole[cache] = rule(cache)
    assert stats.top_budget() == max(top, stats.all_hot_budget())
    budgets = pr.budget_steps(stats, 12)
    for b in budgets:
        stats._whole.setdefault(b - stats.fixed_bytes, rule(b - stats.fixed_bytes))
    assert budgets[-1] >= top
    p = pr.predict(stats, dev, top)
    assert p.whole_layers == 2 and p.whole_bytes == whole_all
    assert p.read_bytes == stats.read_extra and p.hit_rate == 1.0 and p.io_s == 0.0
    plan = pr.cache_plan(stats, top - stats.fixed_bytes - whole_all, skip=(True, False, True))
    assert plan.hot_k == [0, stats.layers[1].n_bundles, 0] and plan.n_prefetch == 0
    # layer 1 from its cache entries as before, layers 0 and 2 their three model matrices at 18 GB/s (no repack gain)
    rate = 18e9 * pr.REPACK_GAIN
    L1 = stats.layers[1]
    want = ((L1.dense_bytes * 0.6 * pr.FLASH_COMPUTE_FACTOR + L1.predictor_bytes + 10 * MB) / rate
            + sum(3 * (L.dense_bytes // 4) for L in (stats.layers[0], stats.layers[2])) / 18e9)
    assert p.token_s == pytest.approx(want + pr.TOKEN_OVERHEAD_S + 3 * pr.LAYER_OVERHEAD_S)
    # every layer read whole: no neuron cache at all
    assert pr.cache_plan(stats, 0, skip=(True, True, True)) == pr.CachePlan([0, 0, 0], 0, 0, 0)


def test_the_plugin_rule_reads_layers_whole_only_beside_every_other_bundle(smollm2: Path, smol_sidecar: Path) -> None:
    """native.dense_whole_layers is the plugin's rule (test_memory_budget runs it in decode): a cache below the bundles
    reads no layer whole, one that holds every layer's matrices reads every layer the placement leaves to ggml-cpu so,
    each in an entry of one size; a sidecar that is not there is refused by name."""
    from pi2_gguf.runtime import native

    none, zero = native.dense_whole_layers(smollm2, smol_sidecar, 1 << 20)
    assert not any(none) and zero == 0
    pick, whole = native.dense_whole_layers(smollm2, smol_sidecar, 1 << 40)
    cost = native.sparse_cost_c(smol_sidecar)
    assert pick == [c >= 1.0 for c in cost] and any(pick)
    assert whole > 0 and whole % sum(pick) == 0  # one entry size (the largest picked layer's) for each
    with pytest.raises(Pi2Error, match="nothing.pi2.gguf"):
        native.dense_whole_layers(smollm2, smol_sidecar.parent / "nothing.pi2.gguf", 1 << 30)


def test_reads_overlap_only_what_was_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's reads overlap its compute only as far as they were read ahead: a layer with predictors reads after
    them (compute + reads), one without reads its misses ahead where the prefetch room holds them."""
    import dataclasses

    dev = _device()
    base = _stats(tmp_path)
    budget = base.min_budget
    real_plan = pr.cache_plan

    def token(predictors: bool, prefetch: int | None) -> pr.Prediction:
        stats = dataclasses.replace(base, layers=[dataclasses.replace(L, predictor_runs=predictors)
                                                  for L in base.layers])
        if prefetch is not None:
            monkeypatch.setattr(pr, "cache_plan", lambda *a, **k: dataclasses.replace(real_plan(*a, **k),
                                                                                       n_prefetch=prefetch))
        else:
            monkeypatch.setattr(pr, "cache_plan", real_plan)
        return pr.predict(stats, dev, budget)

    serial = token(True, None)
    assert serial.io_s > 0 and serial.token_s == pytest.approx(
        serial.io_s + serial.compute_s + pr.TOKEN_OVERHEAD_S + 3 * pr.LAYER_OVERHEAD_S)
    ahead, none_ahead = token(False, 10**6), token(False, 0)
    assert none_ahead.token_s == pytest.approx(
        none_ahead.io_s + none_ahead.compute_s + pr.TOKEN_OVERHEAD_S + 3 * pr.LAYER_OVERHEAD_S)
    assert ahead.token_s < none_ahead.token_s  # read ahead, the shorter of reads and compute half hidden
    assert ahead.io_s == pytest.approx(none_ahead.io_s)


def test_slower_disk_predicts_slower(tmp_path: Path) -> None:
    stats = _stats(tmp_path)
    fast, slow = _device(), _device()
    for p in slow.reads.values():
        p.throughput_bps /= 10
        p.latency_s *= 10
    b = stats.min_budget
    assert pr.predict(stats, slow, b).token_s > pr.predict(stats, fast, b).token_s
    assert pr.predict(stats, slow, b).read_bytes == pr.predict(stats, fast, b).read_bytes


def test_recommend_and_refusals(tmp_path: Path) -> None:
    stats = _stats(tmp_path)
    dev = _device()
    with pytest.raises(MemoryBudgetError, match=rf"below the least .* {stats.min_budget / MB:.0f} MB \(process 60 MB, "
                                                r"non-FFN weights 40 MB, and a neuron cache"):
        recommend(stats, dev, stats.min_budget - 1, 2, lambda b: pr.predict(stats, dev, b))
    # just above the minimum: the minimum itself, nothing left to the system
    low = recommend(stats, dev, stats.min_budget + 1000, 2, lambda b: pr.predict(stats, dev, b))
    assert low.budget is not None and stats.min_budget <= low.budget <= stats.min_budget + MB
    # plenty, but less than the whole model in RAM: every bundle hot and no more
    top = stats.all_hot_budget()
    rich = recommend(stats, dev, 300 * MB, 2, lambda b: pr.predict(stats, dev, b))
    assert rich.budget == -(-top // MB) * MB
    assert "every bundle is hot" in rich.why
    # enough for everything in RAM (400 MB with the process, a tenth left to the system): no budget if not slower
    ram = recommend(stats, dev, 8000 * MB, 2, lambda b: pr.predict(stats, dev, b))
    assert ram.budget is None or ram.tps > 1.0 / pr.predict_ram(stats, dev, 2)
    cmd = command(Path("/m/x.gguf"), Path("/m/x.pi2.gguf"), 250 * MB, 2)
    assert cmd == "pi2-gguf run /m/x.gguf --memory-budget 250MB -t 2"
    assert "--sidecar /s/y.pi2.gguf" in command(Path("/m/x.gguf"), Path("/s/y.pi2.gguf"), None, 2)


def test_device_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second call reads the cache and measures nothing; --remeasure measures again."""
    f = tmp_path / "data.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    monkeypatch.setattr(device_mod, "READ_SECONDS", 0.02)
    calls: list[int] = []
    real = device_mod.measure_reads

    def counted(path: Path, size: int, *a: object, **k: object) -> ReadPoint:
        calls.append(size)
        return real(path, size, threads=2, seconds=0.02)

    monkeypatch.setattr(device_mod, "measure_reads", counted)
    first = device_mod.profile(f, [4096, 20000], {}, [1], tmp_path / "cache")
    assert sorted(calls) == [4096, 20480] and first.measured == ["read 4096", "read 20480"]
    assert first.reads["4096"].throughput_bps > 0 and first.reads["20480"].latency_s > 0
    again = device_mod.profile(f, [4096, 20000], {}, [1], tmp_path / "cache")
    assert len(calls) == 2 and again.measured == []
    assert again.reads == first.reads
    more = device_mod.profile(f, [4096, 65536], {}, [1], tmp_path / "cache")  # only the new size is measured
    assert calls[2:] == [65536] and more.measured == ["read 65536"]
    fresh = device_mod.profile(f, [4096], {}, [1], tmp_path / "cache", remeasure=True)
    assert calls[3:] == [4096] and fresh.measured == ["read 4096"]
    with pytest.raises(Pi2Error, match="too small"):
        device_mod.measure_reads(f, 8 << 20)


def test_scattered_reads_are_measured_per_bundle_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle size gets a scattered read (whole entries, each its own iovec) beside a contiguous one of the same
    size, the data read through either is the file's, and the cost of an extra entry comes from the two."""
    f = tmp_path / "data.bin"
    data = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    f.write_bytes(data)
    monkeypatch.setattr(device_mod, "READ_SECONDS", 0.02)
    prof = device_mod.profile(f, [65536], {}, [1], tmp_path / "cache", bundles=[3584, 41472])
    assert set(prof.measured) == {"read 65536", "read 229376", "read 229376 in 64", "read 497664",
                                  "read 497664 in 12"}
    seg = prof.reads["229376/3584"]  # at most 64 entries a request
    assert seg.segments == 64 and seg.size == 229376 and seg.throughput_bps > 0
    assert [p.size for p in prof.read_points()] == [65536, 229376, 497664]  # the line is fitted on whole ones
    assert prof.segment_cost(3584) >= 0.0 and prof.segment_cost(999) == 0.0
    # scattered into reversed entries, the bytes still land in file order
    buf = device_mod._HugeBuffer(2 * 4 * 3584)
    try:
        iov = device_mod._segments(buf, 4 * 3584, 3584)
        fd = os.open(f, os.O_RDONLY)
        try:
            assert os.preadv(fd, iov, 4096) == 4 * 3584
        finally:
            os.close(fd)
        assert b"".join(bytes(v) for v in iov) == data[4096:4096 + 4 * 3584]
        del iov
    finally:
        buf.close()
    with pytest.raises(Pi2Error, match="512-byte-aligned"):
        device_mod.measure_reads(f, 4000, segment=1000)


def test_segment_cost_from_the_two_reads() -> None:
    dev = _device()
    n = 512 << 10  # the scattered read measured for 64 KiB bundles: 8 of them
    dev.reads[str(n)] = ReadPoint(n, 1e-3, n / (50e-6 + n / 1e9), True)
    dev.reads[f"{n}/65536"] = ReadPoint(n, 1e-3, n / (50e-6 + n / 1e9 + 7 * 4e-6), True, 8)
    assert dev.segment_cost(65536) == pytest.approx(4e-6, rel=1e-6)
    assert dev.segment_cost(4096) == 0.0  # not measured
    assert [p.size for p in dev.read_points()] == [4096, 65536, n, 1 << 20]


def test_request_cost_fits_the_line() -> None:
    a, b = _device().request_cost()
    assert a == pytest.approx(50e-6, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    assert _device().latency(4096) == pytest.approx(100e-6 + 4096 / 1e9)


def test_compute_measurement() -> None:
    """ggml-cpu's Q4_0 and F16 dot products stream weights at plausible rates (0.2-200 GB/s; on a shared machine two
    threads need not beat one), and a type ggml cannot quantize without an importance matrix is refused."""
    pytest.importorskip("llama_cpp")
    for qtype in (2, 1):  # GGML_TYPE_Q4_0, GGML_TYPE_F16
        for threads in (1, 2):
            assert 0.2e9 < device_mod.measure_compute(qtype, threads, seconds=0.05) < 200e9
    with pytest.raises(Pi2Error, match="importance matrix"):
        device_mod.measure_compute(16, 1, seconds=0.05)  # GGML_TYPE_IQ2_XXS


def test_plugin_times_its_decode_product_and_refuses_what_it_cannot_time() -> None:
    """pi2_time_dense_rows: Q4_K rows of 4,096 values on two threads at a plausible rate; a type out of range, rows
    that are not whole blocks (Q4_K's are 256 values), no rows, no threads or an unbounded time are refused."""
    import ctypes

    from pi2_gguf.runtime import capi

    lib, out = capi.lib(), ctypes.c_double()
    assert lib.pi2_time_dense_rows(12, 4096, 2048, 2, 0.05, ctypes.byref(out)) == 0  # GGML_TYPE_Q4_K
    assert 0.2e9 < out.value < 200e9
    for args in [(-1, 4096, 64, 1, 0.05), (999, 4096, 64, 1, 0.05), (12, 4000, 64, 1, 0.05), (12, 4096, 0, 1, 0.05),
                 (12, 4096, 64, 0, 0.05), (12, 4096, 64, 1, 0.0), (12, 4096, 64, 1, 1e9)]:
        assert lib.pi2_time_dense_rows(*args, ctypes.byref(out)) == -1, args


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from pi2_gguf.cli import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_cli_bad_memory_and_no_sidecar(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --memory and a model without a sidecar: exit 2, one line (the convert command for the latter)."""
    import os

    model = tmp_path / "smol.gguf"
    os.link(smollm2, model)  # no sidecar beside this one
    code, err = _cli(["plan", str(model), "--memory", "lots"], capsys)
    assert code == 2 and err.count("\n") == 0
    assert "--memory 'lots' is not a size" in err
    code, err = _cli(["plan", str(model), "--memory", "8GB"], capsys)
    assert code == 2 and err.count("\n") == 0
    assert f"run `pi2-gguf convert {model}`" in err and err.startswith("pi2-gguf: error: plan needs the model's sidecar")
    code, err = _cli(["plan", str(model), "--sidecar", str(tmp_path / "none.pi2.gguf")], capsys)
    assert code == 2 and "none.pi2.gguf: not found; run `pi2-gguf convert" in err
