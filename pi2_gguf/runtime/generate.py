"""Greedy decoding with timing, shared by the CLI, the benchmarks and the tests.

Run as a module it decodes in a fresh process and prints JSON; that is how stock llama.cpp is run
beside pi2 (once the plugin is registered, every Llama in the process uses it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from .llama_params import model_params_override


@dataclass
class Greedy:
    prompt_tokens: int
    tokens: list[int]
    prompt_seconds: float
    decode_seconds: float
    logits_first: list[float] = field(default_factory=list)  # logits after the prompt, for numeric checks
    pi2_matmuls: int = 0  # FFN matmuls PI2 executed (subprocess runs with --pi2)
    active_fraction: float = 0.0  # sparse decode: active neurons / all neurons, over sparsely decoded tokens
    # with a memory budget, over the decoded tokens: bundle bytes read, bundles found per cache segment,
    # time the compute threads waited for reads; and what the process read from disk in all (/proc/self/io)
    io: dict = field(default_factory=dict)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """The logits llama.cpp left in the context for the last evaluated token: a view, valid until the next
    eval (Llama.scores is only filled with logits_all=True)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def greedy(llm: llama_cpp.Llama, prompt: str, n: int, stop_at_eog: bool = True, keep_logits: bool = False,
           prefix: list[int] | None = None, prompt_limit: int = 0,
           after_prompt: Callable[[], None] | None = None) -> Greedy:
    """Evaluates the prompt, then samples n tokens greedily. Graph evaluations: one for the prompt
    (when it fits in n_batch) plus n - 1 single-token ones (the last sampled token is not evaluated)."""
    llm.reset()
    toks = llm.tokenize(prompt.encode(), add_bos=True) + list(prefix or [])
    if prompt_limit > 0:
        toks = toks[:prompt_limit]  # e.g. 1: every evaluation is a single-token (decode) step
    t0 = time.perf_counter()
    llm.eval(toks)
    prompt_seconds = time.perf_counter() - t0
    logits: list[float] = []
    if keep_logits:
        logits = last_logits(llm).astype(float).tolist()
    if after_prompt is not None:
        after_prompt()
    t1 = time.perf_counter()  # decode time starts after the logits copy
    out: list[int] = []
    for i in range(n):
        # greedy = argmax of the logits llama.cpp left in the context (0.03 ms): llama-cpp-python's
        # Llama.sample(top_k=1) picks the same token but costs ~2 ms of Python per call, which would be
        # timed as decode; llama-bench's tg likewise times llama_decode only
        tok = int(last_logits(llm).argmax())
        if stop_at_eog and llama_cpp.llama_token_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
        if i + 1 < n:
            llm.eval([tok])
    t2 = time.perf_counter()
    return Greedy(len(toks), out, prompt_seconds, t2 - t1, logits)


def greedy_in_subprocess(model: str | Path, prompts: list[str], n: int, pi2: bool, threads: int = 2,
                         ctx: int = 512, eog_stop: bool = False, repack: bool = True,
                         sidecar: str | Path | None = None, mode: str | None = None,
                         keep_prefix: list[int] | None = None, prompt_limit: int = 0, logits: bool = True,
                         timeout: float = 1800) -> list[Greedy]:
    """Greedy decoding in a fresh process: stock llama.cpp (pi2=False) or with the PI2 plugin."""
    cmd = greedy_command(model, prompts, n, pi2, threads, ctx, eog_stop, repack, sidecar, mode, keep_prefix,
                         prompt_limit, logits)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"greedy decoding of {model} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return parse_results(res.stdout)


def parse_results(stdout: str) -> list[Greedy]:
    return [Greedy(**r) for r in json.loads(stdout)]


def greedy_command(model: str | Path, prompts: list[str], n: int, pi2: bool, threads: int = 2, ctx: int = 512,
                   eog_stop: bool = False, repack: bool = True, sidecar: str | Path | None = None,
                   mode: str | None = None, keep_prefix: list[int] | None = None, prompt_limit: int = 0,
                   logits: bool = True, memory_budget: int | None = None) -> list[str]:
    """The command line of a greedy_in_subprocess run (for runners that start it themselves)."""
    cmd = [sys.executable, "-m", "pi2_gguf.runtime.generate", "--model", str(model), "-n", str(n),
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
    return cmd


def _proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


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
    args = ap.parse_args(argv)
    from .plugin import read_counters, register, reset_counters

    if args.pi2:
        register()
    with model_params_override(use_extra_bufts=not args.no_repack):
        if args.pi2:
            from .llama import Llama

            llm = Llama(args.model, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                        verbose=False, sidecar=args.sidecar or False, mode=args.mode, memory_budget=args.memory_budget)
        else:
            llm = llama_cpp.Llama(args.model, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                                  verbose=False)
    prefix = [int(t) for t in args.prefix.split(",") if t]
    res = []
    for p in args.prompt:
        if args.pi2:
            reset_counters()
        read0 = [0]
        at_decode: list = []

        def decode_starts() -> None:  # the I/O figures below are the decode's only
            read0[0] = _proc_read_bytes()
            if args.pi2:
                at_decode.append(read_counters())

        g = greedy(llm, p, args.n, stop_at_eog=not args.no_eog_stop, keep_logits=args.logits, prefix=prefix,
                   prompt_limit=args.prompt_limit, after_prompt=decode_starts)
        g.io = {"process_read_bytes": _proc_read_bytes() - read0[0]}
        if args.pi2:
            c = read_counters()
            g.pi2_matmuls = int(c.matmul_calls.sum())
            if c.sparse_tokens.sum():
                g.active_fraction = float(c.active.sum()) / float(c.neurons.sum())
            c0 = at_decode[0]
            g.io.update(bundle_bytes=int(c.bytes_read.sum() - c0.bytes_read.sum()),
                        hot_hits=int(c.hot_hits.sum() - c0.hot_hits.sum()),
                        cold_hits=int(c.cold_hits.sum() - c0.cold_hits.sum()),
                        misses=int(c.misses.sum() - c0.misses.sum()),
                        io_wait_s=float(c.io_wait_ns.sum() - c0.io_wait_ns.sum()) / 1e9)
        res.append(asdict(g))
    json.dump(res, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
