"""`pi2-gguf convert`: profile -> thresholds -> predictors -> ranking -> bundles -> sidecar GGUF."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from tqdm import tqdm

from ..assets import corpus as corpus_mod
from ..errors import Interrupted, Pi2Error
from ..gguf_file import check_context
from ..paths import check_output
from ..sidecar import format as fmt
from ..sidecar.block_size import default_bundle_align
from ..sidecar.writer import LayerData, OutputCopy, Quality, SidecarMeta, write
from . import bundles as bundles_mod
from . import predictor as pred_mod
from . import resume
from . import sparsity as sp
from .eta import Progress
from .model_ffn import ModelFfn
from .options import (DEFAULT_OUTPUT_ROWS, DEFAULT_PERPLEXITY_BUDGET, DENSE_READS_CHOICES, EXPERT_READS_CHOICES,
                      SMALL_OUTPUT_COPY, ConvertOptions, expert_reads_for)
from .profile import Profile, default_heldout_tokens, default_train_tokens, run_profile
from .resume import WorkDir, key_hash

# a layer whose predictor selects at least this share of the neurons reads every bundle each token (the
# engine then skips the predictor: Qwen2.5-1.5B's select 0.95-0.99)
DENSE_PREDICTION = 0.9
# The plugin's default PI2_IO_GAP (docs/SETTINGS.md; tests/test_convert.py checks they agree): under a
# memory budget a miss within this many bytes of the previous one is read together with the bundles between.
READ_GAP = 32 << 10
# A layer whose one-neuron bundles a token would read at least this share of anyway, wanted or bridged, packs
# several neurons to a bundle (bridged bundles are read into scratch and dropped; packed ones are cached, pad
# less and take fewer requests): the SmallThinker-shaped model (predicted 0.39, 1,728 bytes a neuron in
# 2,048-byte bundles, 99.9% read) decoded 11.9x stock under half its file with 8 neurons to a bundle against
# 6.6x with one (MEASUREMENTS 2026-11-26, "Packed bundles for layers a token reads whole").
PACK_READ_SHARE = 0.9
# the targets tried for the perplexity budget (options.DEFAULT_PERPLEXITY_BUDGET), from the default
# (sparsity.DEFAULT_SPARSITY) down
TARGET_STEPS = (0.4, 0.3, 0.2, 0.1)
# held-out text scored per candidate: 8 chunks of 256 tokens (1,016 tokens scored, as many for dense). 4 chunks (508
# tokens) put Q3_K rows in Qwen2.5-1.5B's layers 4-23 at +2.3% over dense, two other 8-chunk slices at +9.4% and +6.1%
QUALITY_CTX = 256
QUALITY_CHUNKS = 8
# the down columns' reference tried when no sparsity target holds the budget: SmolLM2-135M's Q4_1 columns
# re-quantized cost +4% at sparsity 0.1, Q8_0 ones +0.6%
HIGHER_DOWN_TYPE = QT.Q8_0
# Fewer bytes a token under a memory budget, each tried after the sparsity choice and kept where the held-out
# perplexity stays within the budget (docs/CONVERT.md, "What convert chooses"). On Qwen2.5-Coder-1.5B (2026-11-26):
# - the output matrix's in-RAM copy in Q2_K with 1,024 exact rows instead of Q3_K with 64 (options.SMALL_OUTPUT_COPY);
# - down columns at the gate/up rows' type where the model stores down more precisely (Q4_K_M's Q6_K downs, 14 of
#   28 layers): 54 MB fewer bundle bytes, +1.7% against +1.3% over dense.
# Where both apply they are measured together first (the step's name below), on the first target before it is scored
# alone (where they hold, it holds); each alone only where together they miss the budget.
BOTH_LEVERS = "output copy and downs at the rows' type"
# A tied token embedding (no output.weight: the output layer multiplies by the table) gets output rows by default only
# where its in-RAM copy takes at most this share of the table: gemma-3-270m's 178 MB Q8_0 table has a 94 MB Q4_0
# copy (0.53), and under 340 MB the sidecar with rows decoded 1.94x the one without (MEASUREMENTS.md, 2026-12-07); a
# table already in 4 bits gets a copy about as large (Q4_0), which would only add the exact rows' reads. A model's
# own output matrix gets them whatever its type (Q4_K_M's Q6_K: a Q3_K copy of 0.52).
TIED_COPY_SHARE = 0.75


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    seconds: float
    profile_seconds: float
    size: int
    meta: SidecarMeta
    notes: tuple[str, ...] = ()  # one line each: what convert decided that the user did not ask for exactly


def default_ranks(n_embd: int) -> list[int]:
    """Candidate predictor widths: n_embd/16, /8, /4, /2 (even, at least 16). On the 1.5B ReLU model
    (n_embd 2048) /16 predicts 0.14-0.21 of the neurons against /8's 0.13-0.20 and reads fewer bytes per
    token; in RAM the two decoded alike (within run-to-run noise, docs/CONVERT.md)."""
    return sorted({max(16, (n_embd // d) // 16 * 16) for d in (16, 8, 4, 2)})


@dataclass
class _Planned:
    """One target's layers: what convert writes, before the bundles are laid out (a routed expert read whole from
    the model file has no down columns: None)."""
    layers: list[LayerData]
    downs: list[bundles_mod.DownColumns | None]
    types: list[tuple[int, int, int]]  # gate, up and down type of each layer's bundles
    sources: list[str]                 # where each layer's predictor came from
    # the work directory's keys (hashes) of each layer's plan and down columns (None: a routed expert read whole):
    # what a candidate's perplexity score is keyed by
    keys: list[str] = dataclasses.field(default_factory=list)
    down_keys: list[str | None] = dataclasses.field(default_factory=list)

    def add(self, layer: LayerData, down: bundles_mod.DownColumns | None, types: tuple[int, int, int], source: str,
            key: str, down_key: str | None) -> None:
        self.layers.append(layer)
        self.downs.append(down)
        self.types.append(types)
        self.sources.append(source)
        self.keys.append(key)
        self.down_keys.append(down_key)


@dataclass
class _Work:
    """Where _plan_layers keeps and finds finished pieces (resume.WorkDir), what they are keyed by, and the whole
    convert's progress."""
    dir: WorkDir
    model: dict[str, Any]    # resume.model_identity
    profile: dict[str, Any]  # the profile's key (the options it was made with, or the file it was read from)
    options: dict[str, Any]  # the options every layer's plan depends on (ranks, recall, predictor, ...)
    progress: Progress

    def layer_key(self, il: int, plan: sp.SparsityPlan, layer_type: QT | None, ref: QT | None,
                  shipped: pred_mod.Predictor | None) -> dict[str, Any]:
        """What layer il's plan depends on: the model, the profile, the options, the sparsity plan, its bundles'
        row type, its down columns (their key) and the predictor a checkpoint ships for it."""
        return {"kind": "layer", "model": self.model, "profile": self.profile, "options": self.options,
                "plan": {"method": plan.method, "target": plan.target, "threshold": plan.threshold}, "layer": il,
                "layer_type": None if layer_type is None else layer_type.name,
                "down": key_hash(self.down_key(il, ref)),
                "checkpoint": None if shipped is None else _predictor_hash(shipped)}

    def down_key(self, il: int, ref: QT | None) -> dict[str, Any]:
        return {"kind": "down", "model": self.model, "layer": il, "reference": None if ref is None else ref.name}

    def down(self, model: ModelFfn, il: int, ref: QT | None) -> tuple[bundles_mod.DownColumns, str]:
        """Layer il's down columns against ref (None: the model's down type), from the work directory or made now
        and kept there, with their key."""
        key = self.down_key(il, ref)
        got = self.dir.load("down", key, il)
        if got is not None:
            v, a = got
            return bundles_mod.DownColumns(QT(int(v["qtype"])), a["data"], float(v["tolerance"]), float(v["max_error"]),
                                           tuple((str(t), float(e)) for t, e in v["tried"])), key_hash(key)
        d = bundles_mod.down_columns(model.layers[il]["down"], ref)
        self.dir.save("down", key, {"qtype": int(d.qtype), "tolerance": float(d.tolerance),
                                    "max_error": float(d.max_error), "tried": [[t, float(e)] for t, e in d.tried]},
                      {"data": d.data}, il)
        return d, key_hash(key)


_LAYER_FLOATS = ("threshold", "density", "cutoff", "recall", "precision", "predicted_density", "down_tolerance",
                 "down_error", "product_threshold")
_LAYER_INTS = ("n_ff", "rank", "hot_count", "gate_type", "up_type", "down_type")
_LAYER_ARRAYS = ("w1", "b1", "w2", "b2", "order", "freq")


def _layer_piece(ld: LayerData, source: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    values: dict[str, Any] = {n: float(getattr(ld, n)) for n in _LAYER_FLOATS}
    values.update({n: int(getattr(ld, n)) for n in _LAYER_INTS})
    values["source"] = source
    return values, {n: getattr(ld, n) for n in _LAYER_ARRAYS}


def _layer_from_piece(values: dict[str, Any], arrays: dict[str, np.ndarray], n_ff: int) -> tuple[LayerData, str]:
    """The LayerData a layer piece holds (KeyError/ValueError where it is not one of n_ff neurons)."""
    kw: dict[str, Any] = {n: float(values[n]) for n in _LAYER_FLOATS}
    kw.update({n: int(values[n]) for n in _LAYER_INTS})
    kw.update({n: arrays[n] for n in _LAYER_ARRAYS})
    if kw["n_ff"] != n_ff or kw["order"].shape != (n_ff,) or kw["freq"].shape != (n_ff,) or kw["w2"].shape[0] != n_ff:
        raise ValueError(f"a layer of {kw['n_ff']} neurons, not {n_ff}")
    return LayerData(bundle_size=0, **kw), str(values["source"])


def _layer_types(il: int, bundle_type: QT | None, bundle_layers: frozenset[int] | None,
                 down_type: QT | None) -> tuple[QT | None, QT | None]:
    """Layer il's bundle row type (bundle_type where it applies to the layer, else None: the model's own) and the type
    its down columns are measured against (down_type where given, else that row type)."""
    layer_type = bundle_type if bundle_layers is None or il in bundle_layers else None
    return layer_type, layer_type if down_type is None else down_type


def _bundle_qtype(name: str | None, flag: str, n_embd: int) -> QT | None:
    """The ggml type a --bundle-type/--down-type names, checked to be one bundles can store for rows of n_embd."""
    if name is None:
        return None
    try:
        qt = QT[name.upper()]
    except KeyError:
        raise Pi2Error(f"{flag} {name!r} is not a ggml type name (e.g. q3_k, q4_0, q4_k)") from None
    try:
        bundles_mod.check_bundle_type(qt, n_embd)
    except ValueError as e:
        raise Pi2Error(f"{flag}: {e}") from e
    return qt


def parse_layers(spec: str, n_layer: int, flag: str) -> frozenset[int]:
    """'4-23' or '0,2,5-7' -> those layer indices, each checked to be one of the model's n_layer."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise Pi2Error(f"{flag} {spec!r}: {part.strip()!r} is not a layer or a range of layers like 4-23") from None
        if a > b:
            raise Pi2Error(f"{flag} {spec!r}: {part.strip()!r} runs backwards")
        if not 0 <= a <= b < n_layer:
            raise Pi2Error(f"{flag} {spec!r}: {part.strip()!r} is not within the model's layers 0-{n_layer - 1}")
        out.update(range(a, b + 1))
    return frozenset(out)


# a layer's planning holds about this many float32 arrays of [profiled tokens, n_ff] at once (gate, activation,
# magnitude, up, product and their held-out rows, with numpy's temporaries)
_PLAN_ARRAYS = 8


def _plan_workers(model: ModelFfn, prof: Profile, n_planned: int) -> int:
    """Layers planned side by side: two where the machine has two cores or more and two layers' arrays take at most
    a quarter of its memory, else one. A function of the machine and the model alone, not of the memory free at the
    moment: a layer's predictor weights can differ in their last bits with numpy's BLAS on one thread or two, and a
    convert resumed on the same machine writes the bytes an uninterrupted one writes."""
    if (os.cpu_count() or 1) < 2 or n_planned < 2:
        return 1
    n_ff = max(model.n_ff(il) for il in range(model.n_layer))
    layer = _PLAN_ARRAYS * (prof.n_train + prof.n_heldout) * n_ff * 4 + 2 * n_ff * model.n_embd * 4
    return 2 if 2 * layer <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4 else 1


@contextlib.contextmanager
def _blas_threads(n: int | None) -> Iterator[None]:
    """numpy's BLAS limited to n threads inside (None: as it is): threadpoolctl, which knows each BLAS numpy may
    be built with (its OpenBLAS has no thread-count API of numpy's own)."""
    if n is None:
        yield
        return
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    with threadpool_limits(limits=n, user_api="blas"):
        yield


def _plan_layers(model: ModelFfn, prof: Profile, plans: list[sp.SparsityPlan], ranks: list[int], recall: float,
                 epochs: int, predictor: str, shipped: dict[int, pred_mod.Predictor],
                 down_cache: dict[int, bundles_mod.DownColumns], bundle_type: QT | None, down_type: QT | None,
                 bundle_layers: frozenset[int] | None, progress: bool, whole: frozenset[int] = frozenset(),
                 work: _Work | None = None, step: str = "layers",
                 w2_type: str = fmt.DEFAULT_PREDICTOR_W2_TYPE) -> list[_Planned]:
    """Thresholds, ranking, predictors and down columns of every layer for each sparsity plan (of one method), in
    one pass over the layers: a layer's gate and up values on the profile, its predictors' basis and their outputs
    are computed once for all the plans (they do not depend on the target), the thresholds, labels and cutoffs per
    plan. The down columns do not depend on the plan either: kept in down_cache for the next call. bundle_type: the
    type bundles store gate/up rows in and measure down columns against (None: the model's own); down_type, where
    given, the one down columns are measured against instead. bundle_layers: the layers bundle_type applies to
    (None: all). whole: routed experts read whole from the model file, which get no thresholds, predictors or
    bundles. w2_type: the type decode holds the predictors' W2 in (their widths and cutoffs are weighed so). work:
    the work directory a layer's plan and down columns are taken from where an earlier convert left
    them, and kept in as they are made; its progress counts the layers of `step`. A layer's plan depends on nothing
    planned before it (no state carries from layer to layer), so a layer taken from there is the one planned now."""
    assert plans and len({p.method for p in plans}) == 1

    def act(g: np.ndarray) -> np.ndarray:
        return model.act(g)

    # every plan's active sets are score(g) > threshold: |act(g)| for CATS, act(g) > 0 i.e. g > 0 for ReLU
    method = plans[0].method
    score = pred_mod.score_fn(method, act)
    out = [_Planned([], [], [], [], [], []) for _ in plans]

    Done = dict[int, tuple[LayerData, str, float | None]]  # plan index -> (plan, predictor source, seconds if taken)

    def job(il: int) -> tuple[bundles_mod.DownColumns, str, list[dict[str, Any]], Done]:
        """Layer il's down columns (their key) and each plan's (LayerData, predictor source, seconds if taken from
        the work directory), made or taken from there; what is made is kept there."""
        t_layer = time.monotonic()
        layer_type, ref = _layer_types(il, bundle_type, bundle_layers, down_type)
        dkey = ""
        if work is not None:
            if il not in down_cache:
                down_cache[il], dkey = work.down(model, il, ref)
            else:
                dkey = key_hash(work.down_key(il, ref))
        elif il not in down_cache:
            down_cache[il] = bundles_mod.down_columns(model.layers[il]["down"], ref)
        down = down_cache[il]
        lkeys: list[dict[str, Any]] = []
        done: Done = {}
        if work is not None:
            for k, plan in enumerate(plans):
                lkeys.append(work.layer_key(il, plan, layer_type, ref, shipped.get(il)))
                got = work.dir.load("layer", lkeys[k], il)
                if got is not None:
                    try:
                        ld, src = _layer_from_piece(*got, model.n_ff(il))
                    except (KeyError, ValueError, TypeError) as e:
                        work.dir.recomputed.append(f"layer {il} ({e})")
                    else:
                        done[k] = (ld, src, got[0].get("seconds"))
        if len(done) < len(plans):
            made = _plan_layer(model, prof, il, [p for k, p in enumerate(plans) if k not in done], score, act, ranks,
                               recall, epochs, predictor, shipped.get(il), layer_type, down, w2_type)
            todo = [k for k in range(len(plans)) if k not in done]
            # a layer's share of the step's time: layers planned side by side share it
            seconds = (time.monotonic() - t_layer) / len(todo) / workers
            for k, (ld, src) in zip(todo, made):
                done[k] = (ld, src, None)
                if work is not None:
                    values, arrays = _layer_piece(ld, src)
                    work.dir.save("layer", lkeys[k], {**values, "seconds": seconds}, arrays, layer=il)
        return down, dkey, lkeys, done

    planned = [il for il in range(model.n_layer) if il not in whole]
    place = {il: k for k, il in enumerate(planned)}
    workers = _plan_workers(model, prof, len(planned))
    bar = tqdm(range(model.n_layer), desc="layers", unit="layer", disable=not progress)
    with _blas_threads(1 if workers > 1 else None), ThreadPoolExecutor(workers) as pool:
        # layers are planned `workers` at a time, each on one BLAS thread (numpy's elementwise work, about half of a
        # layer's, runs on one core, so two layers side by side use both), and taken in order
        ahead = {il: pool.submit(job, il) for il in planned[:workers]}
        try:
            for il in bar:
                if work is not None:
                    work.progress.advance(step, 0, timed=False)  # the time since the last layer was not this step's
                    bar.set_postfix_str(work.progress.postfix(), refresh=False)
                ffn = model.layers[il]
                if il in whole:
                    qt = (int(ffn["gate"].qtype), int(ffn["up"].qtype), int(ffn["down"].qtype))
                    for pl in out:
                        pl.add(LayerData.whole(model.n_ff(il), *qt), None, qt, "whole", "whole", None)
                    if work is not None:  # not a unit of the step (its units are the layers planned): the mark moves on
                        work.progress.advance(step, 0, timed=False)
                    continue
                down, dkey, lkeys, done = ahead.pop(il).result()
                at = place[il] + workers
                if at < len(planned):
                    ahead[planned[at]] = pool.submit(job, planned[at])
                for k, pl in enumerate(out):
                    ld, src, _ = done[k]
                    pl.add(ld, down, (ld.gate_type, ld.up_type, ld.down_type), src,
                           key_hash(lkeys[k]) if work is not None else "", dkey if work is not None else None)
                if work is not None:
                    if all(s is not None for _, _, s in done.values()):  # every plan taken from the work directory
                        work.progress.advance(step, 1, timed=False)
                        work.progress.seed("layer", done[0][2], 1)
                    else:
                        work.progress.advance(step, 1)
        finally:
            for f in ahead.values():  # stopped (Ctrl-C, an error): layers not begun are not planned
                f.cancel()
    return out


def _plan_layer(model: ModelFfn, prof: Profile, il: int, plans: list[sp.SparsityPlan],
                score: Callable[[np.ndarray], np.ndarray], act: Callable[[np.ndarray], np.ndarray], ranks: list[int],
                recall: float, epochs: int, predictor: str, shipped: pred_mod.Predictor | None,
                layer_type: QT | None, down: bundles_mod.DownColumns,
                w2_type: str = fmt.DEFAULT_PREDICTOR_W2_TYPE) -> list[tuple[LayerData, str]]:
    """Layer il's LayerData and predictor source under each plan: the values every plan needs computed once."""
    ffn = model.layers[il]
    gate_w = ffn["gate"].dequantized()
    g_train = model.gate_values(il, gate_w, prof.train[il])
    g_held = model.gate_values(il, gate_w, prof.heldout[il])
    a_train, a_held = act(g_train), act(g_held)
    mag_train, mag_held = np.abs(a_train), np.abs(a_held)
    method = plans[0].method
    prod_train = prod_held = y_drelu = y_drelu_held = None
    if method == "product":
        up_w = ffn["up"].dequantized()
        prod_train = np.abs(a_train * model.up_values(il, up_w, prof.train[il]))
        prod_held = np.abs(a_held * model.up_values(il, up_w, prof.heldout[il]))
        del up_w
    elif model.activation == "drelu":
        # active iff gate > 0 and up > 0: the predictor need not catch a neuron whose up is not positive
        up_w = ffn["up"].dequantized()
        # the training-free predictor needs labels on the validation rows only (a third of convert's time)
        rows = slice(-pred_mod.validation_rows(len(prof.train[il])), None) if predictor == "svd" else slice(None)
        y_drelu = (mag_train[rows] > 0) & (prof.train[il][rows] @ up_w.T > 0)
        y_drelu_held = (mag_held > 0) & (prof.heldout[il] @ up_w.T > 0)
        del up_w
    del a_train, a_held
    n_embd = model.n_embd
    gate_t = layer_type if layer_type is not None else ffn["gate"].qtype
    up_t = layer_type if layer_type is not None else ffn["up"].qtype
    costs = pred_mod.Costs(fmt.row_size(gate_t, n_embd) + fmt.row_size(up_t, n_embd) + fmt.row_size(down.qtype, n_embd),
                           w2_type)
    memo: dict[Any, Any] = {}  # the predictors' basis and outputs, shared by the plans
    made: list[tuple[LayerData, str]] = []
    for plan in plans:
        tp = 0.0
        y_train = y_held = None  # the active neurons, where they are not just mag > th
        if method == "product":
            assert prod_train is not None and prod_held is not None
            th, tp = sp.product_thresholds(plan, mag_train, prod_train)
            y_train = sp.active(mag_train, th, prod_train, tp)
            y_held = sp.active(mag_held, th, prod_held, tp)
            density = float(y_held.mean())
        elif y_drelu is not None and y_drelu_held is not None:
            th, y_train, y_held = 0.0, y_drelu, y_drelu_held
            density = float(y_drelu_held.mean())
        else:
            th = sp.layer_threshold(plan, mag_train)
            density = float(sp.active(mag_held, th).mean())
        # the ranking and the hot count follow the neurons whose gate passes th: those are the ones whose
        # bundles (gate, up and down) a token reads
        freq = sp.active(mag_train, th).mean(axis=0).astype(np.float32)
        order = sp.ranking(freq)
        fitted = pred_mod.fit_layer(score, th, gate_w, prof.train[il], g_train, prof.heldout[il], g_held, ranks,
                                    recall, costs, epochs=epochs, y_train=y_train, y_held=y_held, kind=predictor,
                                    shipped=shipped, gate_bias=model.biases.get(il, (None,))[0], memo=memo,
                                    order=order)
        p = fitted.predictor
        made.append((LayerData(
            n_ff=model.n_ff(il), threshold=th, density=density, rank=p.rank, cutoff=p.cutoff,
            recall=fitted.heldout.recall, precision=fitted.heldout.precision,
            predicted_density=fitted.heldout.density, hot_count=sp.hot_count(freq), bundle_size=0,
            gate_type=int(gate_t), up_type=int(up_t), down_type=int(down.qtype),
            down_tolerance=down.tolerance, down_error=down.max_error,
            w1=p.w1.astype(np.float16), b1=p.b1, w2=p.w2.astype(np.float16), b2=p.b2, order=order,
            # an expert's neurons are as hot as they fire when it is routed times how often it is (a memory
            # budget's hot segment ranks neurons of all layers and experts by this)
            freq=freq * np.float32(prof.expert_share[il]) if prof.expert_share else freq,
            product_threshold=tp), fitted.source))
    return made


def _predictor_hash(p: pred_mod.Predictor) -> str:
    """What identifies a predictor a checkpoint ships (a layer's plan weighs it)."""
    h = hashlib.sha256()
    for a in (p.w1, p.b1, p.w2, p.b2, np.float64(p.cutoff)):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _lower_downs(model: ModelFfn, planned: _Planned) -> list[int]:
    """The layers whose model down type has more bits than their gate/up rows (and whose columns do too)."""
    bits = bundles_mod.bits_per_weight
    # the model's own down type, not the columns': columns convert raised to Q8_0 (no target held with the
    # model's types) stay raised
    return [il for il, (g, u, d) in enumerate(planned.types) if planned.downs[il] is not None and
            g == u and bits(model.layers[il]["down"].qtype) > bits(QT(g)) and bits(QT(d)) > bits(QT(g))]


def _downs_at_row_type(model: ModelFfn, planned: _Planned, work: _Work | None = None) -> _Planned | None:
    """planned with the down columns of every layer whose model down type has more bits than its gate/up rows'
    re-quantized at the rows' type (Q4_K_M's Q6_K downs at Q4_K); None where no layer has such a down."""
    lower = _lower_downs(model, planned)
    return _with_downs(model, planned, {il: QT(planned.types[il][0]) for il in lower}, work) if lower else None


def _with_downs(model: ModelFfn, planned: _Planned, refs: dict[int, QT], work: _Work | None = None) -> _Planned:
    """planned with layer il's down columns measured against refs[il]. The predictors stay as fitted: a predictor's
    width is chosen by the bytes it makes a token read, and the down columns' share of those is the same at every
    width (active neurons times a column's bytes), so the choice is the one a plan against refs would make."""
    layers, downs, types = list(planned.layers), list(planned.downs), list(planned.types)
    down_keys = list(planned.down_keys)
    for il, ref in refs.items():
        g, u, _ = types[il]
        if work is not None:
            down, down_keys[il] = work.down(model, il, ref)
        else:
            down = bundles_mod.down_columns(model.layers[il]["down"], ref)
        downs[il], types[il] = down, (g, u, int(down.qtype))
        layers[il] = dataclasses.replace(layers[il], down_type=int(down.qtype), down_tolerance=down.tolerance,
                                         down_error=down.max_error)
    return _Planned(layers, downs, types, planned.sources, planned.keys, down_keys)


def bridged_read_share(p: float, bundle_bytes: int, gap: int = READ_GAP) -> float:
    """The share of a layer's one-neuron bundles (bundle_bytes each, back to back) a token reads under a budget
    when each is wanted with probability p on its own: a run of unwanted bundles between two wanted ones is read
    with them when it spans at most gap bytes, so a neuron is left only inside a longer run, of more than
    k = gap // bundle_bytes. Runs of r unwanted neurons hold a share r p^2 q^r of them (q = 1 - p), and the sum over
    r > k is q^(k+1) ((k+1) p + q)."""
    q = 1.0 - min(max(p, 0.0), 1.0)
    k = gap // bundle_bytes
    return 1.0 - q ** (k + 1) * ((k + 1) * (1.0 - q) + q)


def _meta(model: ModelFfn, prof: Profile, plan: sp.SparsityPlan, recall: float, planned: _Planned,
          bundle_align: int, bundle_neurons: int | None, expert_reads: str | None = None,
          date: str | None = None, dense_reads: str | None = None, predictor_w2_type: str | None = None) -> SidecarMeta:
    """The sidecar's keys for one plan, with each layer's bundle layout: several neurons to a bundle only where
    a token reads (nearly) every bundle anyway, wanted or bridged (bridged_read_share >= PACK_READ_SHARE); a
    layer whose reads leave most bundles out keeps one neuron per bundle."""
    layers, types = planned.layers, planned.types
    if bundle_neurons is not None:
        layouts = [fmt.bundle_layout(*t, model.n_embd, bundle_align, bundle_neurons) for t in types]
    else:
        layouts = [fmt.bundle_layout(*t, model.n_embd, bundle_align) for t in types]
        packed = [il for il, ld in enumerate(layers) if planned.downs[il] is not None and
                  bridged_read_share(ld.predicted_density, layouts[il].size) >= PACK_READ_SHARE]
        if packed:
            for il, lay in zip(packed, fmt.packed_bundle_layouts([types[il] for il in packed], model.n_embd, bundle_align)):
                layouts[il] = lay
    for ld, lay, down in zip(layers, layouts, planned.downs):
        if down is not None:  # a routed expert read whole keeps no bundles
            ld.bundle_size, ld.bundle_neurons = lay.size, lay.neurons
    return SidecarMeta(
        source_architecture=model.architecture, source_name=model.name, source_file_size=model.file_size,
        tensor_fingerprints=model.tensor_fingerprints(), n_embd=model.n_embd, activation=model.activation,
        activation_threshold=model.activation_threshold,
        method=plan.method, target=-1.0 if plan.target is None else plan.target, recall_target=recall,
        corpus=prof.corpus, corpus_sha256=prof.corpus_sha256, tokens=prof.n_train, heldout_tokens=prof.n_heldout,
        date=date if date is not None else _now(), layers=layers, bundle_align=bundle_align,
        n_expert=model.n_expert, layer_experts=model.layer_experts if model.mixed else None, expert_reads=expert_reads,
        dense_reads=dense_reads, predictor_w2_type=predictor_w2_type)


def _now() -> str:
    """The calibration date convert records (pi2.calib.date): now, or SOURCE_DATE_EPOCH's time where that is set
    (reproducible builds' convention: two converts of the same model and options then write the same bytes)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            when = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc)
        except (ValueError, OverflowError, OSError):
            raise Pi2Error(f"SOURCE_DATE_EPOCH={epoch!r}: seconds since 1970 (an integer)") from None
    else:
        when = dt.datetime.now(dt.timezone.utc)
    return when.isoformat(timespec="seconds")


def _down_columns(planned: _Planned, il: int) -> bundles_mod.DownColumns:
    """Layer il's down columns (a layer with bundles: never a routed expert read whole, which the writer skips)."""
    down = planned.downs[il]
    if down is None:
        raise AssertionError(f"layer {il} is read whole from the model file: it has no bundles to write")
    return down


class _OutputCopies:
    """The output matrix's in-RAM copy a sidecar with output rows carries (output.pi2_copy), so that a budget's load
    reads it instead of quantizing the matrix (Qwen2.5-1.5B: 7.4 of a load's 9.3 s here): made once per type by the
    plugin's own routine (native.output_copy), for every sidecar convert writes, candidates included."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._made: dict[bool, OutputCopy | None] = {}
        self._sizes: dict[bool, tuple[int, int] | None] = {}

    def size(self, small: bool) -> tuple[int, int] | None:
        """(ggml type, bytes) of the copy of that kind (native.output_copy_size, asked once)."""
        if small not in self._sizes:
            from ..runtime import native
            self._sizes[small] = native.output_copy_size(self.model, small)
        return self._sizes[small]

    def rows_pay(self, model: ModelFfn) -> bool:
        """Whether output rows are recorded by default: a model's own output matrix, or a tied embedding whose copy
        is small enough (TIED_COPY_SHARE)."""
        if model.has_output:
            return True
        got = self.size(False)
        return got is not None and got[1] <= TIED_COPY_SHARE * model.output_bytes

    def small_differs(self) -> bool:
        """Whether PI2_OUTPUT_COPY=q2_k makes another copy than the default (not where rows are not whole K-quant
        blocks: both are Q4_0), so that measuring it as a lever can change anything."""
        small, default = self.size(True), self.size(False)
        return small is not None and default is not None and small[0] != default[0]

    def of(self, meta: SidecarMeta) -> OutputCopy | None:
        if not meta.output_rows:
            return None
        small = meta.output_copy == "q2_k"  # PI2_OUTPUT_COPY's value; absent: q3_k
        if small not in self._made:
            from ..runtime import native
            made = native.output_copy(self.model, small)
            self._made[small] = OutputCopy(*made) if made is not None else None
        return self._made[small]


def _write(out: Path, model: ModelFfn, meta: SidecarMeta, planned: _Planned, progress: bool,
           overall: Progress | None = None, step: str = "write", copies: _OutputCopies | None = None) -> None:
    def layer_bundles(il: int) -> np.ndarray:
        ffn = model.layers[il]
        lay = fmt.bundle_layout(*planned.types[il], model.n_embd, meta.bundle_align, meta.layers[il].bundle_neurons,
                                meta.layers[il].bundle_size)
        gate_t, up_t, _ = planned.types[il]
        return bundles_mod.layer_bundles(bundles_mod.bundle_rows(ffn["gate"], QT(gate_t)),
                                         bundles_mod.bundle_rows(ffn["up"], QT(up_t)), _down_columns(planned, il),
                                         meta.layers[il].order, lay)

    with tqdm(total=model.n_layer, desc="write", unit="layer", disable=not progress) as bar:
        def done(il: int) -> None:
            if overall is not None:
                # a routed expert read whole writes no bundles: not a unit of the step (written_layers)
                overall.advance(step, 0.0 if planned.sources[il] == "whole" else 1.0)
                bar.set_postfix_str(overall.postfix(), refresh=False)
            bar.update(1)

        write(out, meta, layer_bundles, progress=done, output_copy=copies.of(meta) if copies is not None else None)
    if overall is not None:
        overall.end(step)


def _perplexity(model: Path, text: str, ctx: int, sidecar: Path | None, threads: int | None, progress: bool) -> float:
    """Perplexity of held-out text as decode computes it: dense without a sidecar, else predicted mode under a
    memory budget the whole FFN fits in (its bundles, down columns re-quantized, and the predictors a budget runs),
    each chunk one batch of decode's neurons for each token, as the dense score is taken in batches.
    In RAM layers may be left dense and many-active downs take the model's own rows, which a budget does not
    have: Qwen2.5-1.5B at 50% product scored +1.8% in RAM with every layer held, +3.6% under a budget (2026-11-25)."""
    from ..bench.perplexity import perplexity
    from ..runtime.native import resident_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # llama.cpp's repacking copies the weights into RAM (its default, and what users run): a model of half the RAM or
    # more is scored from its mapped file instead, both scores alike (a 16.8 GB MoE model on 24 GB was OOM-killed)
    kw: dict = {"repack": model.stat().st_size < ram // 2}
    if sidecar is not None:
        # the budget counts this process too, which holds the profile and the down columns convert made (on
        # Qwen2.5-1.5B a budget of model + sidecar + 1 GB left too little by 8 MB once two types' columns were held)
        budget = min(resident_bytes() + model.stat().st_size + sidecar.stat().st_size + (1 << 30), int(0.8 * ram))
        # the bundles, always: a budget that holds every layer whole would read a SiLU model's layers from the model
        # file instead (PI2_DENSE_READS=auto) and score the dense model
        kw.update(sidecar=sidecar, mode="predicted", memory_budget=budget, settings={"dense_reads": "bundles"})
    try:
        return perplexity(model, text, ctx, QUALITY_CHUNKS, threads=threads, progress=progress, chunk_batches=True,
                          **kw).ppl
    except Pi2Error as e:
        raise Pi2Error(f"{e} (on held-out text for --perplexity-budget)") from e


def _options(options: ConvertOptions | None, overrides: dict[str, Any]) -> ConvertOptions:
    """options (None: the defaults) with overrides replacing fields of the same name."""
    names = {f.name for f in dataclasses.fields(ConvertOptions)}
    for name in overrides:
        if name not in names:
            raise TypeError(f"convert() got an unexpected keyword argument {name!r}")
    return dataclasses.replace(options or ConvertOptions(), **overrides)


def convert(model_path: str | Path, output: str | Path | None = None, options: ConvertOptions | None = None,
            **overrides: Any) -> ConvertResult:
    """Writes the sidecar of the model at model_path to output (None: MODEL.pi2.gguf beside it) and returns what
    was written. options: ConvertOptions (None: the defaults), with overrides, keyword arguments named as its
    fields, replacing theirs: convert(model, out, sparsity=0.4, progress=False)."""
    o = _options(options, overrides)
    t0 = time.time()
    model = ModelFfn(model_path)
    out = Path(output) if output is not None else fmt.sidecar_path_for(model.path)
    if out.resolve() == model.path.resolve():
        raise Pi2Error(f"the sidecar would overwrite the model {model.path}")
    check_output(out, "sidecar")  # before minutes of profiling
    notes: list[str] = []
    bundle_align = o.bundle_align
    if bundle_align is None:
        bundle_align, why = default_bundle_align(out)
        if o.dense_reads != "model":  # whole layers write no bundles
            notes.append(f"bundles aligned to {bundle_align} bytes: {why} (--bundle-align sets it; a sidecar moved to "
                         f"a device with larger blocks reads through the page cache)")
    try:
        fmt.check_bundle_align(bundle_align)
        if o.bundle_neurons is not None:
            fmt.check_bundle_neurons(o.bundle_neurons)
    except ValueError as e:
        raise Pi2Error(str(e)) from e
    bundle_qt = _bundle_qtype(o.bundle_type, "--bundle-type", model.n_embd)
    down_qt = _bundle_qtype(o.down_type, "--down-type", model.n_embd)
    bundle_layers = None
    if o.bundle_type_layers is not None:
        if bundle_qt is None:
            raise Pi2Error("--bundle-type-layers needs --bundle-type (the type those layers' bundles take)")
        bundle_layers = parse_layers(o.bundle_type_layers, model.n_layer, "--bundle-type-layers")
    if o.output_rows is not None and not 0 <= o.output_rows <= fmt.MAX_OUTPUT_ROWS:
        raise Pi2Error(f"--output-rows {o.output_rows}: a number of rows from 0 to {fmt.MAX_OUTPUT_ROWS}")
    if o.output_copy is not None and o.output_copy not in fmt.OUTPUT_COPIES:
        raise Pi2Error(f"--output-copy {o.output_copy!r}: one of {', '.join(fmt.OUTPUT_COPIES)}")
    if o.output_copy is not None and o.output_rows == 0:
        raise Pi2Error("--output-copy needs output rows (--output-rows 0 keeps the output matrix in RAM)")
    if o.expert_reads not in EXPERT_READS_CHOICES:
        raise Pi2Error(f"--expert-reads {o.expert_reads!r}: one of {', '.join(EXPERT_READS_CHOICES)}")
    if o.expert_reads == "model" and not model.n_expert:
        raise Pi2Error(f"--expert-reads model: {model.path.name} has no routed experts")
    expert_reads = expert_reads_for(o.expert_reads, model.activation) if model.n_expert else None
    whole = frozenset(fmt.routed_layers(model.layer_experts if model.mixed else None, model.n_expert, model.n_layer)) \
        if expert_reads == "model" else frozenset()
    if whole:
        why = "--expert-reads model" if o.expert_reads == "model" else \
            f"--expert-reads auto: {model.activation} experts are not sparse enough for neuron bundles to pay"
        notes.append(f"routed experts are read whole from the model file under a memory budget ({why}): the sidecar "
                     f"holds no copy of them")
    if o.dense_reads not in DENSE_READS_CHOICES:
        raise Pi2Error(f"--dense-reads {o.dense_reads!r}: one of {', '.join(DENSE_READS_CHOICES)}")
    if o.dense_reads == "model" and model.n_expert:
        raise Pi2Error(f"--dense-reads model: {model.path.name} is an MoE model (--expert-reads says where its routed "
                       f"experts are read from; its dense layers keep neuron bundles)")
    if o.dense_reads == "model" and (o.sparsity is not None or o.threshold is not None):
        raise Pi2Error("--dense-reads model reads every layer whole, which has no sparsity: --sparsity and --threshold "
                       "need --dense-reads bundles")
    # pi2.dense_reads is written only where it says model: a bundles sidecar is the one earlier converts wrote
    dense_reads = "model" if o.dense_reads == "model" else None
    if dense_reads == "model":
        whole = frozenset(range(model.n_layer))
        notes.append("FFN layers are read whole from the model file under a memory budget (--dense-reads model): the "
                     "sidecar holds no copy of them, and in RAM they run dense")
    elif expert_reads == "bundles" and o.expert_reads == "auto":
        notes.append(f"routed experts are read from neuron bundles under a memory budget (--expert-reads auto: "
                     f"{model.activation} experts read only the neurons that fire; --expert-reads model reads them "
                     f"whole from the model file, with no copy here)")
    if o.predictor not in pred_mod.KINDS:
        raise Pi2Error(f"predictor must be one of {', '.join(pred_mod.KINDS)}, got {o.predictor!r}")
    if not 0.5 <= o.recall < 1.0:
        raise Pi2Error(f"recall target must be in [0.5, 1), got {o.recall}")
    try:
        plan = sp.SparsityPlan.for_activation(model.activation, o.sparsity, o.threshold, o.criterion)
    except ValueError as e:
        raise Pi2Error(str(e)) from e
    if o.ranks and not all(2 <= r <= 2 * model.n_embd for r in o.ranks):
        raise Pi2Error(f"--ranks {','.join(map(str, o.ranks))}: a predictor width is 2 to {2 * model.n_embd} "
                       f"(twice n_embd) for {model.path.name}")
    shipped: dict[int, pred_mod.Predictor] = {}
    if o.checkpoint is not None:
        from ..importer import checkpoint_predictors

        found = checkpoint_predictors.load(o.checkpoint, model.n_layer, model.n_embd, model.n_ff(0))
        if found.layers and plan.method != "relu":
            notes.append(f"checkpoint predictors ignored: they predict ReLU-family activity, and this model's "
                         f"FFN is {model.activation}")
        else:
            shipped = found.layers
            if found.reason:
                notes.append(f"checkpoint predictors {'partly ' if shipped else ''}ignored: {found.reason}")
    prof_given: Profile | None = None
    if o.profile is not None:
        prof_given = Profile.load(o.profile)
        prof_given.check_model(model.path)
    else:
        corpus = corpus_mod.load(o.text)
        if dense_reads == "model":  # no layer is planned and no expert routed: nothing to profile
            prof_given = Profile.unprofiled(model.path, corpus.name, corpus.sha256, model.n_layer, model.n_embd)
    ranks = list(o.ranks) if o.ranks else default_ranks(model.n_embd)
    # The configuration (docs/CONVERT.md, "What convert chooses"): the target asked for, or by default the
    # largest of TARGET_STEPS whose perplexity on held-out text stays within the budget, each candidate written
    # and then measured as a memory budget decodes it; where none holds, more precise down columns
    adaptive = o.sparsity is None and o.threshold is None and plan.method != "relu" and o.perplexity_budget is not None \
        and len(whole) < model.n_layer  # a model of routed experts read whole has no sparse layer to choose for
    targets = [plan.target] + ([t for t in TARGET_STEPS if t < (plan.target or 0.0)] if adaptive else [])
    ctx = check_context(model.path, None, "--perplexity-budget", QUALITY_CTX) if o.perplexity_budget is not None else 0

    # The work directory (docs/CONVERT.md, "Resume"): each piece of finished work is kept there as it is done, keyed
    # by everything it depends on, and a rerun takes the pieces whose keys still match
    def log(msg: str) -> None:
        if o.progress:
            tqdm.write(msg, file=sys.stderr)

    workdir = WorkDir(out, log)
    model_id = resume.model_identity(model.path, model.fingerprint())
    dropped = workdir.open(model_id, fresh=not o.resume)
    if dropped is not None:
        log(f"work directory {workdir.path}: its pieces were {dropped}; starting fresh" if dropped != "--no-resume"
            else f"--no-resume: the work directory's pieces dropped, starting fresh")
    moe = bool(model.n_expert)
    if prof_given is None:  # the profile's size as it will be taken (and keyed)
        o = dataclasses.replace(o, train_tokens=o.train_tokens or default_train_tokens(model.n_embd, moe),
                                heldout_tokens=o.heldout_tokens or default_heldout_tokens(moe))
    prof_key: dict[str, Any] = {"file": resume.file_identity(o.profile)} if o.profile is not None else {
        "model": model_id, "corpus": corpus.name, "corpus_sha256": corpus.sha256, "train_tokens": o.train_tokens,
        "heldout_tokens": o.heldout_tokens, "window": o.window}
    n_train = prof_given.n_train if prof_given is not None else o.train_tokens or default_train_tokens(model.n_embd, moe)
    progress = Progress(o.progress, n_train)
    work = _Work(workdir, model_id, prof_key, {"ranks": ranks, "recall": o.recall, "epochs": o.epochs,
                                               "predictor": o.predictor, "method": plan.method,
                                               "w2_type": o.predictor_w2_type}, progress)
    sparse_layers = [il for il in range(model.n_layer) if il not in whole]

    def layer_key(il: int, target: float | None, down: QT | None) -> dict[str, Any]:
        layer_type, ref = _layer_types(il, bundle_qt, bundle_layers, down)
        return work.layer_key(il, dataclasses.replace(plan, target=target), layer_type, ref, shipped.get(il))

    def label(target: float | None) -> str:
        if not sparse_layers:  # routed experts read whole: no sparsity, the candidate differs only by its output rows
            return "every layer read whole"
        return f"sparsity {target:.2f}" if target is not None else \
            "ReLU-family sparsity" if plan.method == "relu" else "the threshold given"

    done: list[str] = []
    if prof_given is None and workdir.has("profile", prof_key):
        done.append("profile")
    for t in targets:
        n = sum(workdir.has("layer", layer_key(il, t, down_qt), il) for il in sparse_layers)
        if n:
            done.append(f"{n} of {len(sparse_layers)} layers at {label(t)}")
    n_scores = sum(p.name.startswith("ppl-") for p in workdir.pieces())
    if n_scores:
        done.append(f"{n_scores} perplexity score{'s' if n_scores > 1 else ''}")
    if done:
        log(f"resuming from {workdir.path}: {', '.join(done)} done (--no-resume starts fresh)")
    success = False
    try:
        res = _convert_work(o, model, out, notes, t0, bundle_align, bundle_qt, down_qt, bundle_layers, expert_reads,
                            dense_reads, whole, plan, shipped, prof_given, work, targets, adaptive, ctx, ranks, sparse_layers, label)
        success = True
        return res
    except (Pi2Error, Interrupted) as e:
        # what stopped it says so in its one line: the finished work stays for the same command to resume
        if workdir.pieces():
            e.kept = workdir.path
        raise
    finally:
        workdir.close(remove=success or not workdir.pieces())


def _convert_work(o: ConvertOptions, model: ModelFfn, out: Path, notes: list[str], t0: float, bundle_align: int,
                  bundle_qt: QT | None, down_qt: QT | None, bundle_layers: frozenset[int] | None,
                  expert_reads: str | None, dense_reads: str | None, whole: frozenset[int], plan: sp.SparsityPlan,
                  shipped: dict[int, pred_mod.Predictor], prof_given: Profile | None, work: _Work,
                  targets: list[float | None], adaptive: bool, ctx: int, ranks: list[int], sparse_layers: list[int],
                  label: Callable[[float | None], str]) -> ConvertResult:
    """convert() from the profile on, with its work directory open."""
    progress, workdir = work.progress, work.dir
    n_sparse = len(sparse_layers)
    n_written = float(max(n_sparse, 1))  # a write step's units: the layers with bundles (whole experts write none)
    budget_on = o.perplexity_budget is not None
    score_tokens = QUALITY_CHUNKS * ctx
    # the steps known now (the further targets and levers are added when convert decides to run them)
    if prof_given is None:
        assert o.heldout_tokens is not None  # convert() resolved the default
        progress.expect("profile", "profile", float(progress.train_tokens + o.heldout_tokens))
    progress.expect(f"layers {label(targets[0])}", "layer", n_sparse)
    if budget_on:
        progress.expect("perplexity dense", "ppl_dense", score_tokens)
        progress.expect(f"write {label(targets[0])}", "write", n_written)
        progress.expect(f"perplexity {label(targets[0])}", "ppl_sparse", score_tokens)
    progress.expect("write", "write", n_written)

    prof: Profile
    if prof_given is not None:
        prof = prof_given
    else:
        got = workdir.load("profile", work.profile)
        loaded = _profile_from_piece(*got, workdir) if got is not None else None
        if loaded is not None:
            prof = loaded
            progress.end("profile")
            progress.seed("profile", got[0].get("seconds") if got else None, prof.n_train + prof.n_heldout)
        else:
            # the status line once the first window is profiled: run_profile refuses bad input first, in one line
            progress.begin("profile", None)
            t_profile = time.monotonic()
            said: list[bool] = []

            def tick(n: int) -> str:
                progress.advance("profile", n)
                if not said:
                    said.append(True)
                    progress.say(f"profiling {progress.train_tokens} + {o.heldout_tokens} held-out tokens")
                return progress.postfix()

            prof = run_profile(model.path, corpus_mod.load(o.text), o.train_tokens, o.heldout_tokens, o.window,
                               o.threads, o.progress, tick=tick)
            progress.end("profile")
            values, arrays = _profile_piece(prof)
            workdir.save("profile", work.profile, {**values, "seconds": time.monotonic() - t_profile}, arrays)
    t_prof = time.time() - t0
    # the calibration date (pi2.calib.date): when this profile was first taken, kept across resumes
    date_key = {"profile": work.profile}
    got_date = workdir.load("date", date_key) if not os.environ.get("SOURCE_DATE_EPOCH") else None
    date = str(got_date[0]["date"]) if got_date is not None else _now()
    if got_date is None:
        workdir.save("date", date_key, {"date": date})
    progress.train_tokens = prof.n_train
    routed_share: list[float] | None = None
    reuse: list[float] | None = None
    if model.n_expert:
        if prof.n_layer != len(model.layer_experts):
            raise Pi2Error(f"profile has {prof.n_layer} layers; the model has {len(model.layer_experts)} FFN layers")
        prof = prof.experts(model.layer_experts, model.n_expert, whole)  # one profile per sidecar layer
        routed_share = prof.expert_share  # how often each expert was routed: inspect's expert hotness
        reuse = prof.expert_reuse  # and how often again on the next token: its routing's locality
    if prof.n_layer != model.n_layer or prof.n_embd != model.n_embd:
        raise Pi2Error(f"profile has {prof.n_layer} layers of width {prof.n_embd}; the model's FFN has "
                       f"{model.n_layer} of width {model.n_embd}")

    copies = _OutputCopies(model.path)
    rows = o.output_rows if o.output_rows is not None else \
        DEFAULT_OUTPUT_ROWS if o.perplexity_budget is not None and copies.rows_pay(model) else None
    rows = rows or None  # 0: nothing recorded, the plugin's default (the matrix in RAM)
    copy = o.output_copy if rows is not None else None
    down_cache: dict[int, bundles_mod.DownColumns] = {}
    choice: list[str] = []

    planned_at: dict[float | None, _Planned] = {}

    def plan_at(target: float | None, beside: tuple[float | None, ...] = ()) -> tuple[sp.SparsityPlan, _Planned]:
        """The plan at target, and those at the targets beside it made in the same pass (kept for a later call)."""
        plan_k = dataclasses.replace(plan, target=target)
        if target in planned_at:
            return plan_k, planned_at[target]
        step = f"layers {label(target)}"
        progress.expect(step, "layer", n_sparse)
        progress.begin(step, f"planning {n_sparse} layers at {label(target)}"
                       + (f" (and at {', '.join(label(t) for t in beside)} in the same pass)" if beside else ""))
        made = _plan_layers(model, prof, [dataclasses.replace(plan, target=t) for t in (target, *beside)], ranks,
                            o.recall, o.epochs, o.predictor, shipped, down_cache, bundle_qt, down_qt, bundle_layers,
                            o.progress, whole, work, step, o.predictor_w2_type)
        planned_at.update(zip((target, *beside), made))
        progress.end(step)
        return plan_k, made[0]

    # the lowest target beside the first: where every layer's predictor selects nearly all neurons at the first
    # (SiLU models), convert takes the lowest, and the pass that made the first made it too (the gate and up values,
    # the predictors' basis and outputs are the same for every target)
    plan_k, planned = plan_at(targets[0], tuple(targets[-1:]) if adaptive and len(targets) > 1 else ())
    if adaptive and all(ld.predicted_density >= DENSE_PREDICTION for ld in planned.layers):
        # each token reads every bundle at any target: the lowest keeps the most quality for the same bytes
        choice.append(f"sparsity {targets[-1]:.2f}: at {targets[0]:.2f} every layer's predictor already selects "
                      f">= {DENSE_PREDICTION:.0%} of its neurons, so a token reads every bundle at any target")
        for step in (f"write {label(targets[0])}", f"perplexity {label(targets[0])}"):
            progress.drop(step)
        targets = targets[-1:]
        if budget_on:
            progress.expect(f"write {label(targets[0])}", "write", n_written)
            progress.expect(f"perplexity {label(targets[0])}", "ppl_sparse", score_tokens)
        plan_k, planned = plan_at(targets[0])
    # every layer read whole (no sparsity to choose): the output copy is still a lever (downs are the model's own)
    precision_free = (adaptive or (budget_on and not sparse_layers)) and bundle_qt is None and down_qt is None
    # the levers a held budget measures (they are dropped again where it does not hold): both together where both
    # apply, each alone where only one does (or together they miss the budget, decided then)
    copy_lever = precision_free and rows is not None and o.output_rows is None and o.output_copy is None and \
        copies.small_differs()
    down_lever = precision_free and bool(_lower_downs(model, planned))
    for lever, on in ((BOTH_LEVERS, copy_lever and down_lever), ("output copy", copy_lever and not down_lever),
                      ("downs at the rows' type", down_lever and not copy_lever)):
        if on:
            progress.expect(f"write {lever}", "write", n_written)
            progress.expect(f"perplexity {lever}", "ppl_sparse", score_tokens)
    if copy_lever and down_lever and budget_on:
        # measured together first: where they hold (Qwen2.5-1.5B) the target alone is not scored, so the time left
        # counts it only once they miss (it counted it, and read 3.5 minutes left where 1 was)
        progress.drop(f"write {label(targets[0])}")
        progress.drop(f"perplexity {label(targets[0])}")

    def meta_of(plan_k: sp.SparsityPlan, planned: _Planned) -> SidecarMeta:
        return dataclasses.replace(_meta(model, prof, plan_k, o.recall, planned, bundle_align, o.bundle_neurons,
                                         expert_reads, date, dense_reads,
                                         o.predictor_w2_type if sparse_layers else None),
                                   output_rows=rows, output_copy=copy, routed_share=routed_share, reuse=reuse)

    def final_write(meta: SidecarMeta, planned: _Planned) -> None:
        progress.begin("write", f"writing {out}")
        _write(out, model, meta, planned, o.progress, progress, "write", copies)

    if o.perplexity_budget is None:
        meta = meta_of(plan_k, planned)
        final_write(meta, planned)
        return _result(out, t0, t_prof, meta, planned, shipped, o.recall, o.predictor, notes + _resumed(workdir))

    budget = o.perplexity_budget
    heldout = "\n\n".join(corpus_mod.load(o.text).split()[1])  # the calibration corpus's held-out documents
    dense: list[float] = []

    def score_key(candidate: str | None) -> dict[str, Any]:
        return {"model": work.model, "text_sha256": hashlib.sha256(heldout.encode()).hexdigest(), "ctx": ctx,
                "chunks": QUALITY_CHUNKS, "candidate": candidate}

    def measure(plan_k: sp.SparsityPlan, planned: _Planned, what: str) -> tuple[SidecarMeta, float | None]:
        """Writes the candidate and scores it; None (and a note) where the perplexity tool cannot run. A score the
        work directory holds for the same candidate is taken from there, the candidate not written."""
        meta = meta_of(plan_k, planned)
        # everything the candidate's bytes depend on but its date (which does not change its perplexity)
        candidate = key_hash({"layers": planned.keys, "downs": planned.down_keys, "bundle_align": bundle_align,
                              "bundle_neurons": o.bundle_neurons, "rows": rows, "copy": copy,
                              "expert_reads": expert_reads, "dense_reads": dense_reads, "profile": work.profile})
        try:
            if not dense:
                got = workdir.load("ppl", score_key(None))
                if got is not None:
                    dense.append(float(got[0]["ppl"]))
                    progress.end("perplexity dense")
                    progress.seed("ppl_dense", got[0].get("seconds"), score_tokens)
                else:
                    progress.begin("perplexity dense", "scoring the model alone (dense) on held-out text")
                    t_ppl = time.monotonic()
                    dense.append(_perplexity(model.path, heldout, ctx, None, o.threads, o.progress))
                    progress.advance("perplexity dense", score_tokens)
                    workdir.save("ppl", score_key(None), {"ppl": dense[0], "seconds": time.monotonic() - t_ppl})
            got = workdir.load("ppl", score_key(candidate))
            if got is not None:
                progress.end(f"write {what}")
                progress.end(f"perplexity {what}")
                progress.seed("ppl_sparse", got[0].get("seconds"), score_tokens)
                return meta, float(got[0]["ppl"])
            progress.begin(f"write {what}", f"writing the candidate with {what}")
            _write(out, model, meta, planned, o.progress, progress, f"write {what}", copies)
            progress.begin(f"perplexity {what}", f"scoring the candidate with {what} on held-out text")
            t_ppl = time.monotonic()
            ppl = _perplexity(model.path, heldout, ctx, out, o.threads, o.progress)
            progress.advance(f"perplexity {what}", score_tokens)
            workdir.save("ppl", score_key(candidate), {"ppl": ppl, "seconds": time.monotonic() - t_ppl})
            return meta, ppl
        except Pi2Error as e:  # the sidecar stands; only its quality is unknown
            notes.append(f"perplexity not measured, the configuration kept: {e}")
            return meta, None

    def within(ppl: float) -> bool:
        return ppl <= dense[0] * (1.0 + budget)

    def rel(ppl: float) -> str:
        return f"{ppl / dense[0] - 1:+.1%}"

    tried: list[str] = []  # "0.50 (+3.6%)" per target measured
    best: tuple[sp.SparsityPlan, _Planned, SidecarMeta, float] | None = None
    # both byte levers on the first target first: where they hold together (as on Qwen2.5-1.5B) the target alone is not
    # scored (the levers only take precision away, so it holds too); where they do not, it is, and each lever alone
    together: bool | None = None  # held, missed, or not measured first
    n_low = 0
    for k, target in enumerate(targets):
        if k > 0:
            for step, kind in ((f"write {label(target)}", "write"), (f"perplexity {label(target)}", "ppl_sparse")):
                progress.expect(step, kind, n_written if kind == "write" else score_tokens)
            # the targets after it in the same pass: the shared work is most of a layer's
            plan_k, planned = plan_at(target, tuple(t for t in targets[k + 1:] if t not in planned_at))
        lowered = _downs_at_row_type(model, planned, work) if k == 0 and copy_lever and down_lever else None
        if lowered is not None:
            n_low = sum(a != b for a, b in zip(lowered.types, planned.types))
            rows, copy = SMALL_OUTPUT_COPY[1], SMALL_OUTPUT_COPY[0]
            meta, ppl = measure(plan_k, lowered, BOTH_LEVERS)
            if ppl is not None and within(ppl):
                together = True
                best = (plan_k, lowered, meta, ppl)
                tried.append(f"{target if target is not None else 0.0:.2f} ({rel(ppl)} with both levers)")
                notes.append(f"output matrix's copy in {copy.upper()} with {rows} exact rows and down columns at the "
                             f"rows' type in {n_low} layers, together: {rel(ppl)}, within the budget, both kept (the "
                             f"target without them was not scored: it takes no precision they take)")
                progress.drop(f"write {label(target)}")
                progress.drop(f"perplexity {label(target)}")
                break
            together = False
            rows, copy = DEFAULT_OUTPUT_ROWS, None
            progress.expect(f"write {label(target)}", "write", n_written)
            progress.expect(f"perplexity {label(target)}", "ppl_sparse", score_tokens)
            notes.append(f"output matrix's copy in {SMALL_OUTPUT_COPY[0].upper()} with {SMALL_OUTPUT_COPY[1]} exact rows "
                         f"and down columns at the rows' type in {n_low} layers, together: "
                         f"{rel(ppl) if ppl is not None else 'not measured'}, beyond the budget; each measured alone")
        meta, ppl = measure(plan_k, planned, label(target))
        if ppl is None:
            best = None
            break
        best = (plan_k, planned, meta, ppl)
        tried.append(f"{target if target is not None else 0.0:.2f} ({rel(ppl)})")
        if within(ppl) or not adaptive:
            break
    if best is not None and adaptive:
        t, held, packed = best[0].target, within(best[3]), targets[0] != plan.target
        if not choice:
            choice.append(f"sparsity {t:.2f}, " + ("the first target within the budget" if held else
                                                   "no target within the budget") + f" (tried {', '.join(tried)})")
        if packed or len(tried) > 1:  # one note: the choice, or that none held
            why = (choice[0].partition(": ")[2] if packed else
                   f"the first target whose perplexity stays within +{budget:.1%} (tried {', '.join(tried)})")
            notes.append(f"sparsity {t:.2f} chosen: {why}" if held else
                         f"no sparsity target down to {t:.2f} stays within +{budget:.1%} (tried {', '.join(tried)})")
    elif best is not None and not sparse_layers:
        choice.append("no sparsity: every FFN layer is " + ("read whole from the model file" if dense_reads == "model" else
                                                            "a routed expert read whole from the model file"))
        if not within(best[3]):
            notes.append(f"perplexity {best[3]:.4g} is {rel(best[3])} over dense ({dense[0]:.4g}), beyond the budget of "
                         f"+{budget:.1%}: the output matrix's copy costs it (--output-rows 0 keeps it in RAM)")
    elif best is not None:
        choice.append(f"sparsity {best[0].target:.2f} as given" if best[0].target is not None else "threshold as given")
        if not within(best[3]):
            lever = ("a lower --sparsity keeps more quality" if best[0].target is not None else
                     "the predictors leave active neurons out: a higher --recall keeps more quality")
            notes.append(f"perplexity {best[3]:.4g} is {rel(best[3])} over dense ({dense[0]:.4g}), beyond the budget of "
                         f"+{budget:.1%}: {lever}")

    if together and best is not None:
        choice.append(f"down columns at the gate/up rows' type in {n_low} layers ({rel(best[3])} with the output copy)")
    if best is None or not within(best[3]) or together:  # the levers below run only where the budget holds
        for lever in (BOTH_LEVERS, "output copy", "downs at the rows' type"):
            progress.drop(f"write {lever}")
            progress.drop(f"perplexity {lever}")
    elif together is False:  # measured together first and missed: each alone
        progress.drop(f"write {BOTH_LEVERS}")
        progress.drop(f"perplexity {BOTH_LEVERS}")
        for lever in ("output copy", "downs at the rows' type"):
            progress.expect(f"write {lever}", "write", n_written)
            progress.expect(f"perplexity {lever}", "ppl_sparse", score_tokens)
    if best is not None and precision_free and not within(best[3]) and any(
            bundles_mod.bits_per_weight(d.qtype) < bundles_mod.bits_per_weight(HIGHER_DOWN_TYPE)
            for d in best[1].downs if d is not None):
        # no target holds with the model's down precision: the re-quantized down columns may be what costs
        what = f"{HIGHER_DOWN_TYPE.name} down columns"
        progress.expect(f"write {what}", "write", n_written)
        progress.expect(f"perplexity {what}", "ppl_sparse", score_tokens)
        plan_k, planned = best[0], _with_downs(model, best[1], {il: HIGHER_DOWN_TYPE for il in sparse_layers}, work)
        meta, ppl = measure(plan_k, planned, what)
        if ppl is not None:
            verdict = "within the budget" if within(ppl) else "still beyond the budget"
            notes.append(f"down columns measured against {HIGHER_DOWN_TYPE.name}: {rel(ppl)} at sparsity "
                         f"{best[0].target:.2f}, {verdict} (the model's types: {rel(best[3])})")
            if ppl < best[3]:
                choice.append(f"down columns against {HIGHER_DOWN_TYPE.name} ({rel(ppl)}; the model's types "
                              f"{rel(best[3])})")
                best = (plan_k, planned, meta, ppl)

    if best is not None and precision_free and within(best[3]) and not together:
        # fewer bytes a token under a budget, each alone, kept only within the budget: where both apply they were
        # measured together on the first target (above): this runs where only one applies, or together they missed
        lowered = _downs_at_row_type(model, best[1], work)
        n_low = sum(a != b for a, b in zip(lowered.types, best[1].types)) if lowered is not None else 0
        if copy_lever:
            rows, copy = SMALL_OUTPUT_COPY[1], SMALL_OUTPUT_COPY[0]
            meta, ppl = measure(best[0], best[1], "output copy")
            if ppl is not None and within(ppl):
                notes.append(f"output matrix's copy in {copy.upper()} with {rows} exact rows: {rel(ppl)} "
                             f"(Q3_K with {DEFAULT_OUTPUT_ROWS}: {rel(best[3])}), kept")
                best = (best[0], best[1], meta, ppl)
            else:
                notes.append(f"output matrix's copy in {copy.upper()} with {rows} exact rows: "
                             f"{rel(ppl) if ppl is not None else 'not measured'}, beyond the budget; Q3_K kept")
                rows, copy = DEFAULT_OUTPUT_ROWS, None
        if lowered is not None:
            meta, ppl = measure(best[0], lowered, "downs at the rows' type")
            if ppl is not None and within(ppl):
                notes.append(f"down columns at the rows' type in {n_low} layers: {rel(ppl)} (the model's types: "
                             f"{rel(best[3])}), kept")
                choice.append(f"down columns at the gate/up rows' type in {n_low} layers ({rel(ppl)}; the model's types "
                              f"{rel(best[3])})")
                best = (best[0], lowered, meta, ppl)
            else:
                notes.append(f"down columns at the rows' type in {n_low} layers: "
                             f"{rel(ppl) if ppl is not None else 'not measured'}, beyond the budget; the model's kept")

    if rows is not None:
        choice.append(f"output matrix {'' if model.has_output else '(the tied token embedding) '}left in the model "
                      f"file under a memory budget, {rows} exact rows a token"
                      + (f", the rest from a {copy.upper()} copy" if copy is not None else ""))

    if best is None:  # not measured: the last candidate written stands, without quality keys
        meta = meta_of(plan_k, planned)
    else:
        plan_k, planned, meta, ppl = best
        meta = dataclasses.replace(meta, quality=Quality(
            f"{prof.corpus}, held-out documents, {QUALITY_CHUNKS} chunks of {ctx} tokens", dense[0], ppl,
            budget, "; ".join(choice)))
    final_write(meta, planned)  # the choice, with its quality recorded
    return _result(out, t0, t_prof, meta, planned, shipped, o.recall, o.predictor, notes + _resumed(workdir))


def _resumed(workdir: WorkDir) -> list[str]:
    """The note on what was taken from the work directory and what had to be made again."""
    out = []
    if workdir.loaded:
        names = {"profile": ("the profile", ""), "date": ("the calibration date", ""),
                 "layer": ("layer plan", "layer plans"), "down": ("layer's down columns", "layers' down columns"),
                 "ppl": ("perplexity score", "perplexity scores")}
        said = [names[k][0] if not names[k][1] else f"{n} {names[k][n > 1]}" for k, n in sorted(workdir.loaded.items())]
        out.append(f"resumed from {workdir.path}: reused {', '.join(said)}")
    if workdir.recomputed:
        out.append(f"{len(workdir.recomputed)} unusable piece(s) of the work directory computed again: "
                   + "; ".join(workdir.recomputed))
    return out


def _profile_piece(prof: Profile) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return {"model_file": prof.model_file, "model_size": prof.model_size, "corpus": prof.corpus,
            "corpus_sha256": prof.corpus_sha256, "window": prof.window}, prof.arrays()


def _profile_from_piece(values: dict[str, Any], arrays: dict[str, np.ndarray], workdir: WorkDir) -> Profile | None:
    try:
        prof = Profile.from_arrays(str(values["model_file"]), int(values["model_size"]), str(values["corpus"]),
                                   str(values["corpus_sha256"]), int(values["window"]), arrays)
        if any(a.shape[1] != prof.n_embd for a in prof.train + prof.heldout):
            raise ValueError("layers of different widths")
    except (KeyError, ValueError, TypeError, IndexError) as e:
        workdir.recomputed.append(f"profile ({e})")
        return None
    return prof


def _result(out: Path, t0: float, t_prof: float, meta: SidecarMeta, planned: _Planned,
            shipped: dict[int, pred_mod.Predictor], recall: float, predictor: str, notes: list[str]) -> ConvertResult:
    sources = planned.sources
    if shipped:
        used = [il for il, src in enumerate(sources) if src == "checkpoint"]
        notes.append(f"checkpoint predictors used in {len(used)} of {len(shipped)} layers"
                     + (f" ({', '.join(map(str, used))})" if 0 < len(used) < len(shipped) else "")
                     + ("" if len(used) == len(shipped) else
                        f"; the others read more per token at recall {recall} than convert's {predictor} predictors"))
    return ConvertResult(out, time.time() - t0, t_prof, out.stat().st_size, meta, tuple(notes))
