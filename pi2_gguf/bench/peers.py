"""Peer engines as rows of `pi2-gguf bench` (--peer NAME=COMMAND): a command the user built elsewhere (peers are
not ours and are not in the repository; docs/OTHER_ENGINES.md says how to build them), run in the same cgroup, with the
same cold page cache and memory limit as every other row. The command is a template: {model}, {prompt}, {n} and
{threads} are filled in per argument (a prompt with spaces stays one argument). What it printed gives the rates:
BigMoeOnEdge's report (decode and prefill tok/s, MiB read a token, its expert cache's hit rate), llama.cpp's timing
lines (llama_perf_context_print's "prompt eval time" and "eval time": prompt and decode tok/s, decoded runs; any
llama.cpp tool or fork, e.g. SmallThinker's engine), else the last "N tok/s" or "N tokens per second" it printed,
on stdout or stderr. A peer that needs its own model file (SmallThinker's engine: down transposed,
tools/peer_model.py) names it literally in its command instead of {model}."""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import Pi2Error

PLACEHOLDERS = ("model", "prompt", "n", "threads")


@dataclass(frozen=True)
class Peer:
    name: str
    template: str


@dataclass(frozen=True)
class PeerResult:
    decode_tps: float
    prompt_tps: float = 0.0
    decoded: int = 0
    read_per_token_mb: float | None = None  # as the peer reports it
    expert_hit_rate: float | None = None    # its expert cache's hits / lookups


def parse_peer(text: str) -> Peer:
    """NAME=COMMAND; Pi2Error naming the problem when the name or command is missing, the command does not parse as a
    shell command line, or it uses a placeholder other than {model} {prompt} {n} {threads}."""
    name, eq, template = text.partition("=")
    name, template = name.strip(), template.strip()
    if not eq or not name or not template:
        raise Pi2Error(f"--peer '{text}' is not NAME=COMMAND (e.g. bmoe='bmoe-cli -m {{model}} -p {{prompt}} -n {{n}}')")
    try:
        args = shlex.split(template)
    except ValueError as e:
        raise Pi2Error(f"--peer {name}: the command does not parse ({e})") from e
    dummy = {k: "x" for k in PLACEHOLDERS}
    for arg in args:
        try:
            arg.format(**dummy)
        except (KeyError, IndexError, ValueError) as e:
            raise Pi2Error(f"--peer {name}: '{arg}' uses an unknown placeholder or a stray brace ({e}); known: "
                           + " ".join(f"{{{k}}}" for k in PLACEHOLDERS)) from e
    return Peer(name, template)


def peer_command(peer: Peer, model: str, prompt: str, n: int, threads: int) -> list[str]:
    """The command line of one run: the template's arguments with the placeholders filled in."""
    values = {"model": model, "prompt": prompt, "n": str(n), "threads": str(threads)}
    return [arg.format(**values) for arg in shlex.split(peer.template)]


def peer_files(peer: Peer) -> list[Path]:
    """The files a peer's command names literally that exist (an argument, or the value of a NAME=PATH argument such as
    env's EXPERT_BUNDLE_PATH=...), not programs: its own model file and expert bundle, whose page cache a bench
    drops before the peer's run as it does the stock model's (the template's {model} is the stock model itself)."""
    args = shlex.split(peer.template)
    out: list[Path] = []
    for arg in args[1:]:
        if "{" in arg:
            continue
        for text in (arg, arg.partition("=")[2]):
            path = Path(text)
            if text and path.is_file() and path not in out and not os.access(path, os.X_OK):  # not a program
                out.append(path)
    return out


_BMOE_GEN = re.compile(r"generation:\s*(\d+) tokens,\s*[0-9.]+ s/token \(([0-9.]+) tok/s\)")
_BMOE_PREFILL = re.compile(r"prefill:\s*\d+ tokens,\s*[0-9.]+ s \(([0-9.]+) tok/s\)")
_BMOE_READ = re.compile(r"moe-stream: read [0-9.]+ MiB \(([0-9.]+) MiB/token\)")
_BMOE_HIT = re.compile(r"moe-cache:\s*([0-9.]+)% hit")
_LLAMA_RATE = r"\([^,]*,\s*(-?(?:[0-9.]+|inf|nan)) tokens per second\)"
_LLAMA_PROMPT = re.compile(r"prompt eval time =\s*[0-9.]+ ms /\s*\d+ tokens\s*" + _LLAMA_RATE)
_LLAMA_EVAL = re.compile(r"(?<!prompt )eval time =\s*[0-9.]+ ms /\s*(\d+) runs\s*" + _LLAMA_RATE)
_ANY_TPS = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(?:tok(?:ens)?/s|tokens per second)")


def _rate(text: str) -> float:
    """A rate llama.cpp printed with %f: inf or nan (no time measured) is no rate."""
    value = float(text)
    return value if math.isfinite(value) else 0.0


def parse_output(text: str) -> PeerResult | None:
    """The rates a peer printed (its stdout and stderr); None when it printed no tokens per second."""
    gen = _BMOE_GEN.search(text)
    if gen is not None:
        prefill, read, hit = _BMOE_PREFILL.search(text), _BMOE_READ.search(text), _BMOE_HIT.search(text)
        return PeerResult(decode_tps=float(gen.group(2)), decoded=int(gen.group(1)),
                          prompt_tps=float(prefill.group(1)) if prefill else 0.0,
                          read_per_token_mb=float(read.group(1)) * 2**20 / 1e6 if read else None,
                          expert_hit_rate=float(hit.group(1)) / 100 if hit else None)
    evals = _LLAMA_EVAL.findall(text)
    if evals:  # llama.cpp's perf lines: the last report's (a tool may print one per context)
        runs, tps = evals[-1]
        prompts = _LLAMA_PROMPT.findall(text)
        return PeerResult(decode_tps=_rate(tps), decoded=int(runs), prompt_tps=_rate(prompts[-1]) if prompts else 0.0)
    rates = _ANY_TPS.findall(text)
    return PeerResult(decode_tps=float(rates[-1])) if rates else None
