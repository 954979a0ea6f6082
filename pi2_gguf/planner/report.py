"""`pi2-gguf plan MODEL [--memory 8GB]`: the table of predicted decode speed and bytes read per token from the minimum
budget to all in RAM, the budget recommended for the memory given, and the command to run."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import MemoryBudgetError, SidecarError
from ..sidecar import format as fmt
from .device import DeviceProfile
from .model_stats import ModelStats
from .predict import Prediction, budget_steps, predict, predict_ram

# Of the memory given, what a recommended budget leaves to the rest of the machine (the kernel, the page cache the
# model file's load goes through, other processes): a tenth, at most 512 MB, and never below the minimum budget.
LEAVE_SHARE = 0.10
LEAVE_MAX = 512_000_000


@dataclass
class Recommendation:
    memory: int
    budget: int | None      # None: no budget, every weight in RAM
    tps: float
    why: str


def resolve_sidecar(model: Path, sidecar: Path | None) -> Path:
    """The sidecar to plan with: the one given, else MODEL.pi2.gguf beside the model; without one, the convert to
    run (memory_budget.no_sidecar)."""
    from ..runtime.memory_budget import no_sidecar

    path = sidecar if sidecar is not None else fmt.sidecar_path_for(model)
    if not path.is_file():
        if sidecar is not None:
            raise SidecarError(f"sidecar {sidecar}: not found; run `pi2-gguf convert {model} -o {sidecar}`")
        raise SidecarError(no_sidecar(model, "plan"))
    return path


def floor_reason(stats: ModelStats) -> str:
    items = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in stats.fixed.items())
    return (f"{items}, and a neuron cache of at least one layer's bundles ({stats.min_cache / 1e6:.0f} MB; "
            "the cold entries every layer's non-hot bundles pass through)")


def recommend(stats: ModelStats, device: DeviceProfile, memory: int, threads: int,
              predictor: Callable[[int], Prediction]) -> Recommendation:
    """The budget for a machine that can give `memory` bytes: below the minimum refused with the minimum and why;
    else the memory less what the rest of the machine keeps (LEAVE_SHARE, at most LEAVE_MAX), capped where every bundle
    is already hot; no budget at all where the whole model fits and runs at least as fast in RAM."""
    if memory < stats.min_budget:
        raise MemoryBudgetError(
            f"--memory {memory / 1e6:.0f} MB is below the least {stats.model.name} can run in: "
            f"{stats.min_budget / 1e6:.0f} MB ({floor_reason(stats)})")
    leave = min(int(memory * LEAVE_SHARE), LEAVE_MAX)
    usable = max(memory - leave, stats.min_budget)
    top = stats.top_budget()
    if usable >= stats.ram_bytes:
        ram_tps = 1.0 / predict_ram(stats, device, threads)
        hot = predictor(min(usable, top))
        if ram_tps >= hot.tps:
            return Recommendation(memory, None, ram_tps,
                                  f"the whole model ({stats.ram_bytes / 1e6:.0f} MB with its process) fits in "
                                  f"{usable / 1e6:.0f} MB (the {memory / 1e6:.0f} MB less {leave / 1e6:.0f} MB "
                                  "left to the system): no budget, every weight in RAM")
    budget = -(-min(usable, top) // 1_000_000) * 1_000_000
    p = predictor(budget)
    if usable >= top:
        what = ("every layer the plugin may read whole from the model file is read so" if p.whole_layers
                else "every bundle is hot")
        why = (f"{what} from {top / 1e6:.0f} MB on: more memory reads nothing less, so the rest of the "
               f"{memory / 1e6:.0f} MB stays free")
    elif usable == stats.min_budget and memory - leave < stats.min_budget:
        why = (f"the minimum: {memory / 1e6:.0f} MB leaves nothing to the system beyond it (a tenth, up to "
               f"{LEAVE_MAX / 1e6:.0f} MB, is what a budget otherwise leaves)")
    else:
        why = (f"the {memory / 1e6:.0f} MB less {leave / 1e6:.0f} MB left to the system (a tenth, up to "
               f"{LEAVE_MAX / 1e6:.0f} MB: the kernel, the page cache the model's load passes through, other "
               "processes); the budget bounds this process alone")
    return Recommendation(memory, budget, p.tps, why)


def command(model: Path, sidecar: Path, budget: int | None, threads: int) -> str:
    parts = ["pi2-gguf", "run", str(model)]
    if sidecar != fmt.sidecar_path_for(model):
        parts += ["--sidecar", str(sidecar)]
    if budget is not None:
        parts += ["--memory-budget", f"{budget // 1_000_000}MB"]
    parts += ["-t", str(threads)]
    return " ".join(shlex.quote(p) for p in parts)


def table(stats: ModelStats, device: DeviceProfile, budgets: list[int], threads: int) -> tuple[str, list[Prediction]]:
    preds = [predict(stats, device, b, threads) for b in budgets]
    lines = ["| budget | neuron cache hot + cold MB | layers read whole (MB) | cache hits | read/token MB | "
             "requests/token | decode tok/s (predicted) |", "|---|---|---|---|---|---|---|"]
    for p in preds:
        whole = f"{p.whole_layers} ({p.whole_bytes / 1e6:.0f})" if p.whole_layers else "-"
        lines.append(f"| {p.budget / 1e6:.0f} MB | {p.hot_bytes / 1e6:.0f} + {p.cold_bytes / 1e6:.0f} | {whole} | "
                     f"{p.hit_rate:.1%} | {p.read_bytes / 1e6:.2f} | {p.requests:.0f} | {p.tps:.1f} |")
    ram = predict_ram(stats, device, threads)
    lines.append(f"| no budget ({stats.ram_bytes / 1e6:.0f} MB, all in RAM) | - | - | - | 0 | 0 | {1 / ram:.1f} |")
    return "\n".join(lines), preds


def device_line(device: DeviceProfile, stats: ModelStats, threads: int) -> str:
    a, b = device.request_cost()
    pts = device.read_points()
    small = pts[0]
    rates = ", ".join(f"{k.replace('@', ' x')} {v / 1e9:.1f} GB/s" for k, v in sorted(device.compute.items())
                      if k.split("@")[0] in stats.types)
    bundles = sorted({L.bundle_size for L in stats.layers})
    segs = ", ".join(f"{device.segment_cost(s) * 1e6:.1f} us per extra {s}-byte entry" for s in bundles)
    return (f"this machine  {device.machine.get('cpu', '?')}, disk {device.machine.get('disk', '?')}: reads "
            f"{1 / b / 1e9:.2f} GB/s at {len(device.read_points())} sizes, {small.size // 1024} KiB alone "
            f"{small.latency_s * 1e6:.0f} us, {a * 1e6:.1f} us a request in flight"
            f"{f', {segs}' if segs else ''}"
            f"{'' if small.direct else ' (buffered: O_DIRECT refused)'}; dot products {rates}")


def plan_text(stats: ModelStats, device: DeviceProfile, memory: int | None, threads: int) -> str:
    budgets = budget_steps(stats)
    tab, preds = table(stats, device, budgets, threads)
    n_run = sum(L.predictor_runs for L in stats.layers)
    lines = [
        f"model         {stats.model} ({stats.model.stat().st_size / 1e6:.0f} MB), sidecar {stats.sidecar}",
        f"sidecar       {len(stats.layers)} FFN layers, {stats.bundle_bytes / 1e6:.1f} MB of bundles; predictors run in "
        f"{n_run} layers (the others read every bundle); mean density "
        f"{sum(L.density for L in stats.layers) / len(stats.layers):.3f}, predicted "
        f"{sum(L.pred_density for L in stats.layers) / len(stats.layers):.3f}",
        device_line(device, stats, threads),
        f"minimum       {stats.min_budget / 1e6:.0f} MB: {floor_reason(stats)}",
        "",
        f"predicted decode, {threads} threads (from the minimum budget to every bundle hot or every layer the plugin "
        "may read whole from the model file read so, then without a budget):",
        tab,
    ]
    if memory is not None:
        from functools import partial

        rec = recommend(stats, device, memory, threads, partial(predict, stats, device, threads=threads))
        where = "no budget" if rec.budget is None else f"budget {rec.budget / 1e6:.0f} MB"
        lines += ["", f"for --memory {memory / 1e6:.0f} MB: {where}, predicted {rec.tps:.1f} tok/s ({rec.why})",
                  f"run:  {command(stats.model, stats.sidecar, rec.budget, threads)}"]
    else:
        p = preds[-1]
        lines += ["", f"run:  {command(stats.model, stats.sidecar, p.budget, threads)}   (the top of the table; "
                  "--memory SIZE recommends a budget for the memory you have)"]
    if device.measured:
        lines.append(f"(measured now and cached: {', '.join(device.measured)})")
    return "\n".join(lines)
