#!/usr/bin/env python3
"""Two builds of pi2-gguf side by side: this tree's and another source tree's (a `git worktree` of an older commit,
say), decoding the same models in RAM and under a memory budget, every configuration in turn each round. For a
change that should not change speed (a refactor): the table gives new against old per configuration.

    .venv/bin/python tools/bench_builds.py --old ../old-tree --case MODEL SIDECAR BUDGET [--case ...]
        [--rounds 4] [-n 64] [--decode text]

The old tree's plugin is built with CMake against this environment's llama-cpp-python (once, into
OLD/build/bench-plugin); its runs import the old tree's pi2_gguf (PYTHONPATH) and load its plugin (PI2_PLUGIN).
In RAM the sidecar's mode is predicted with the default placement; under the budget (no cgroup: the process sizes
its neuron cache from the budget) the FFN is read from the sidecar with O_DIRECT. Decode text: teacher-forced
held-out text, so a synthetic model's routing follows real text instead of its own repeated token.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pi2_gguf import llama_build  # noqa: E402
from pi2_gguf.bench import PROMPT, heldout_text  # noqa: E402
from pi2_gguf.bench.rounds import Series, ratio, run_in_turn  # noqa: E402
from pi2_gguf.errors import Pi2Error  # noqa: E402
from pi2_gguf.runtime.generate import Greedy  # noqa: E402
from pi2_gguf.runtime.isolated import greedy_command, parse_results  # noqa: E402
from pi2_gguf.runtime.memory_budget import parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def build_old_plugin(old: Path) -> Path:
    """OLD's plugin, built against the installed llama-cpp-python unless its sources are older than the build."""
    import llama_cpp

    out = old / "build" / "bench-plugin"
    so = out / "libggml-pi2.so"
    sources = [p for p in (old / "ggml-backend").rglob("*") if p.is_file()]
    if so.is_file() and all(p.stat().st_mtime <= so.stat().st_mtime for p in sources):
        return so
    wheel = llama_build.ensure_wheel(ROOT / "patches")
    lib = Path(llama_cpp.__file__).parent / "lib"
    subprocess.run(["cmake", "-S", str(old / "ggml-backend"), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPI2_GGML_DIR={wheel.ggml_dir}", f"-DPI2_LLAMA_LIB_DIR={lib}",
                    f"-DPI2_LLAMA_CPP_PYTHON_VERSION={llama_build.LLAMA_CPP_PYTHON_VERSION}",
                    f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "-j", "2"], check=True, capture_output=True)
    if not so.is_file():
        raise Pi2Error(f"building {old}'s plugin made no {so}")
    return so


def run(tree: Path, plugin: Path | None, cmd: list[str]) -> Greedy:
    env = dict(os.environ)
    env.pop("PI2_PLUGIN", None)
    if plugin is not None:  # the old tree: its own package and plugin
        env["PYTHONPATH"] = str(tree)
        env["PI2_PLUGIN"] = str(plugin)
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {res.stderr[-1500:]}")
    return parse_results(res.stdout)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="the other source tree (its ggml-backend/ and pi2_gguf/)")
    ap.add_argument("--case", nargs=3, action="append", required=True, metavar=("MODEL", "SIDECAR", "BUDGET"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", choices=("greedy", "text"), default="text")
    args = ap.parse_args()
    old = args.old.resolve()
    if not (old / "ggml-backend").is_dir() or not (old / "pi2_gguf").is_dir():
        raise SystemExit(f"--old {old}: not a pi2-gguf source tree")
    old_plugin = build_old_plugin(old)
    forced = heldout_text(args.n) if args.decode == "text" else None
    configs: list[tuple[str, Callable[[], Greedy]]] = []
    for model_s, sidecar_s, budget_s in args.case:
        model, sidecar = Path(model_s).resolve(), Path(sidecar_s).resolve()
        budget = parse_size(budget_s, "BUDGET")
        for where, mb in (("in RAM", None), (f"budget {budget / 1e6:.0f} MB", budget)):
            cmd = greedy_command(model, [PROMPT], args.n, pi2=True, threads=args.threads, ctx=1024, logits=False,
                                 sidecar=sidecar, mode="predicted", memory_budget=mb, forced_text=forced)
            for build, tree, plugin in (("old", old, old_plugin), ("new", ROOT, None)):
                configs.append((f"{model.name}, {where}, {build}",
                                lambda tree=tree, plugin=plugin, cmd=cmd: run(tree, plugin, cmd)))
    series: list[Series[Greedy]] = run_in_turn(configs, args.rounds, desc="builds")
    print(f"\n{args.rounds} rounds in turn, {args.n} tokens ({args.decode}), {args.threads} threads; decode tok/s, "
          "medians; new/old: ratio of medians (range of the per-round ratios)\n")
    print("| model, where | old tok/s | new tok/s | new/old |")
    print("|---|---|---|---|")
    for o, n in zip(series[0::2], series[1::2], strict=True):
        name = o.name.rsplit(", ", 1)[0]
        if not (o.ok and n.ok):
            print(f"| {name} | {o.failure[-80:] or '-'} | {n.failure[-80:] or '-'} | - |")
            continue
        r = ratio(n.values("decode_tps"), o.values("decode_tps"))
        print(f"| {name} | {o.median('decode_tps'):.2f} | {n.median('decode_tps'):.2f} | {r} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
