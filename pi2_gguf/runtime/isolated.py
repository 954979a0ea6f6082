"""Greedy decoding in a fresh process, JSON out: how stock llama.cpp runs beside pi2 (once the plugin is
registered, every Llama in the process uses it), and how the benchmarks run each configuration.

    python -m pi2_gguf.runtime.isolated --model M --prompt P [--pi2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp

from .generate import Greedy, greedy
from .llama_params import model_params_override

if TYPE_CHECKING:
    from .llama import Llama


def greedy_in_subprocess(model: str | Path, prompts: list[str], n: int, pi2: bool, threads: int = 2,
                         ctx: int = 512, eog_stop: bool = False, repack: bool = True,
                         sidecar: str | Path | None = None, mode: str | None = None,
                         keep_prefix: list[int] | None = None, prompt_limit: int = 0, logits: bool = True,
                         timeout: float = 1800, llama_site: str | Path | None = None,
                         memory_budget: int | None = None,
                         settings: Mapping[str, str | int | float] | None = None,
                         forced_text: str | None = None) -> list[Greedy]:
    """Greedy decoding in a fresh process: stock llama.cpp (pi2=False) or with the PI2 plugin.
    llama_site: a directory holding another llama-cpp-python build (llama_build.ensure_stock_site: the one
    built without patches/), imported instead of the installed one. settings: per-model PI2 settings
    (docs/SETTINGS.md), e.g. {"layers": "all"}. forced_text: decode steps evaluate this text's tokens (teacher
    forcing, generate.greedy's forced) instead of the tokens picked."""
    cmd = greedy_command(model, prompts, n, pi2, threads, ctx, eog_stop, repack, sidecar, mode, keep_prefix,
                         prompt_limit, logits, memory_budget, settings, forced_text)
    env = None
    if llama_site is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(llama_site), os.environ.get("PYTHONPATH")])))
        cmd.append("--expect-llama-site=" + str(llama_site))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"greedy decoding of {model} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return parse_results(res.stdout)


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak RSS so far in bytes (/proc/PID/status VmHWM; 0 once it is gone). Not ru_maxrss: a
    process started by vfork (subprocess does) records its parent's peak there when it execs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def parse_results(stdout: str) -> list[Greedy]:
    return [Greedy(**r) for r in json.loads(stdout)]


def greedy_command(model: str | Path, prompts: list[str], n: int, pi2: bool, threads: int = 2, ctx: int = 512,
                   eog_stop: bool = False, repack: bool = True, sidecar: str | Path | None = None,
                   mode: str | None = None, keep_prefix: list[int] | None = None, prompt_limit: int = 0,
                   logits: bool = True, memory_budget: int | None = None,
                   settings: Mapping[str, str | int | float] | None = None,
                   forced_text: str | None = None) -> list[str]:
    """The command line of a greedy_in_subprocess run (for runners that start it themselves)."""
    cmd = [sys.executable, "-m", "pi2_gguf.runtime.isolated", "--model", str(model), "-n", str(n),
           "--threads", str(threads), "--ctx", str(ctx)]
    if memory_budget:
        cmd += ["--memory-budget", str(memory_budget)]
    if logits:
        cmd.append("--logits")
    for p in prompts:
        cmd += ["--prompt", p]
    if pi2:
        cmd.append("--pi2")
    if not eog_stop:
        cmd.append("--no-eog-stop")
    if not repack:
        cmd.append("--no-repack")
    if sidecar is not None:
        cmd += ["--sidecar", str(sidecar)]
    if mode is not None:
        cmd += ["--mode", mode]
    if keep_prefix:
        cmd += ["--prefix", ",".join(map(str, keep_prefix))]
    if prompt_limit:
        cmd += ["--prompt-limit", str(prompt_limit)]
    for name, value in (settings or {}).items():
        cmd += ["--setting", f"{name}={value}"]
    if forced_text:
        cmd += ["--forced-text", forced_text]
    return cmd


def _proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _disk_busy_ms(path: str | Path) -> int | None:
    """Milliseconds the block device holding path has had I/O in flight since boot (io_ticks, the 10th field of
    /sys/dev/block/MAJ:MIN/stat); None where the file is not on a block device."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    try:
        fields = stat.read_text().split()
    except OSError:
        return None
    return int(fields[9]) if len(fields) > 9 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="greedy decoding in a fresh process, JSON out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--pi2", action="store_true", help="register the PI2 plugin first")
    ap.add_argument("--no-eog-stop", action="store_true")
    ap.add_argument("--logits", action="store_true")
    ap.add_argument("--prefix", default="", help="token ids appended to each prompt (comma separated)")
    ap.add_argument("--prompt-limit", type=int, default=0, help="keep only the first N prompt tokens")
    ap.add_argument("--no-repack", action="store_true", help="stock CPU path without weight repacking")
    ap.add_argument("--sidecar", help="pi2 sidecar (with --pi2)")
    ap.add_argument("--mode", help="PI2 decode mode (with --pi2)")
    ap.add_argument("--memory-budget", help="whole-process memory budget (with --pi2 and a sidecar)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a per-model PI2 setting (with --pi2), e.g. layers=all")
    ap.add_argument("--forced-text", help="decode steps evaluate this text's tokens instead of the tokens picked")
    ap.add_argument("--expect-llama-site", help="fail unless llama_cpp was imported from this directory")
    args = ap.parse_args(argv)
    if args.expect_llama_site and Path(args.expect_llama_site).resolve() not in Path(llama_cpp.__file__).resolve().parents:
        print(f"llama_cpp was imported from {llama_cpp.__file__}, not from {args.expect_llama_site}", file=sys.stderr)
        return 2
    from .counters import read_counters, reset_counters
    from .plugin import register

    if args.pi2:
        register()
    llm: llama_cpp.Llama
    pi2_llm: Llama | None = None  # llm with --pi2
    with model_params_override(use_extra_bufts=not args.no_repack):
        if args.pi2:
            from .llama import Llama

            llm = pi2_llm = Llama(args.model, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                                  verbose=False, sidecar=args.sidecar or False, mode=args.mode,
                                  memory_budget=args.memory_budget,
                                  settings=dict(kv.split("=", 1) for kv in args.setting))
        else:
            llm = llama_cpp.Llama(args.model, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                                  verbose=False)
    prefix = [int(t) for t in args.prefix.split(",") if t]
    forced = llm.tokenize(args.forced_text.encode(), add_bos=False, special=False) if args.forced_text else None
    if forced is not None and len(forced) < args.n - 1:
        print(f"--forced-text has {len(forced)} tokens, fewer than the {args.n - 1} decode steps", file=sys.stderr)
        return 2
    res = []
    for p in args.prompt:
        if args.pi2:
            reset_counters()
        read0 = [0]
        disk = args.sidecar if args.memory_budget and args.sidecar else args.model  # what decode reads from
        busy0: list[int | None] = [None]
        at_decode: list = []

        def decode_starts() -> None:  # the I/O figures below are the decode's only
            read0[0] = _proc_read_bytes()
            busy0[0] = _disk_busy_ms(disk)
            if args.pi2:
                at_decode.append(read_counters())

        g = greedy(llm, p, args.n, stop_at_eog=not args.no_eog_stop, keep_logits=args.logits, prefix=prefix,
                   prompt_limit=args.prompt_limit, after_prompt=decode_starts, forced=forced)
        g.io = {"process_read_bytes": _proc_read_bytes() - read0[0]}
        busy = _disk_busy_ms(disk)
        if busy is not None and busy0[0] is not None:
            g.io["disk_busy_s"] = (busy - busy0[0]) / 1e3  # the device's, whoever read: other processes count too
        if pi2_llm is not None:
            c = read_counters()
            g.pi2_matmuls = int(c.matmul_calls.sum())
            # MoE: the layers whose routed experts PI2 computed (with a sidecar the engine's counters are per
            # (layer, expert), so matmul calls do not count layers there)
            held = (c.expert_tokens > 0) if c.expert_tokens.sum() else (c.matmul_calls.sum(axis=-1) > 0)
            g.layers_in_pi2 = f"{int(held.sum()) if held.size else 0}/{llama_cpp.llama_model_n_layer(llm.model)}"
            if c.sparse_tokens.sum():
                g.active_fraction = float(c.active.sum()) / float(c.neurons.sum())
            c0 = at_decode[0]
            g.io.update(bundle_bytes=int(c.bytes_read.sum() - c0.bytes_read.sum()),
                        hot_hits=int(c.hot_hits.sum() - c0.hot_hits.sum()),
                        cold_hits=int(c.cold_hits.sum() - c0.cold_hits.sum()),
                        misses=int(c.misses.sum() - c0.misses.sum()),
                        expert_hits=int(c.expert_hits.sum() - c0.expert_hits.sum()),
                        expert_misses=int(c.expert_misses.sum() - c0.expert_misses.sum()),
                        experts_loaded=int(c.experts_loaded.sum() - c0.experts_loaded.sum()),
                        experts_guessed_routed=int(c.experts_guessed_routed.sum() - c0.experts_guessed_routed.sum()),
                        io_wait_s=float(c.io_wait_ns.sum() - c0.io_wait_ns.sum()) / 1e9)
            info = pi2_llm.cache_info()  # the neuron cache's segments, with a memory budget
            if info is not None:
                g.io.update(hot_bytes=info.hot_bytes, cold_bytes=info.cold_bytes, expert_bytes=info.expert_bytes)
            use = pi2_llm.budget_use()
            if use is not None:  # where the budget went: bench and the demo print it
                g.io["budget_use"] = use.to_json()
        g.io["peak_rss"] = peak_rss()
        res.append(asdict(g))
    json.dump(res, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
