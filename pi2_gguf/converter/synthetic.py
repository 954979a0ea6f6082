"""Synthetic llama-arch GGUF models with an activation-sparse FFN, for sizes and sparsities no PyPI
package ships. Their text is meaningless; their shape, size and sparsity are the point.

How the sparsity is made: residual dimension 0 carries a constant (embeddings set it; attention and
FFN outputs never write it), so after the RMS norm x_0 is nearly the same on every token and gate
column 0 acts as a per-neuron bias. Each neuron gets a target firing frequency: a few hot neurons fire
on most tokens, the rest share what is left of the chosen density with a log-normal spread. The
biases are then calibrated on real text: the model is profiled (llama.cpp, eval callback), each
neuron's bias set to the quantile of its measured pre-activations that gives its frequency (in rounds,
until the densities hold through the whole depth), and the result profiled again on held-out text to
report the density it really has. Gate rows are low-rank plus noise, as trained FFNs are, so a
predictor can learn them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tqdm import tqdm

from ..errors import Pi2Error
from . import bundles

ACTIVATIONS = ("relu", "drelu", "fatrelu", "silu")
GATE_MODES = ("lowrank", "context")
# SmolLM2-135M's ffn_gate singular values fall as i^-0.40 to i^-0.48 (layers 3, 15, 27; fit over i >= 5),
# and its top n_embd/16 directions hold 20-24% of the energy
GATE_SPECTRUM_ALPHA = 0.45
FATRELU_THRESHOLD = 0.01  # ProSparse's FATReLU threshold
TOKENIZER_KEYS_SKIP = ("tokenizer.chat_template",)
# the model file's own note of how it was made (a key of the synthetic model, not of a sidecar)
NOTE_KEY = "pi2.synthetic.note"


@dataclass(frozen=True)
class Shape:
    n_embd: int = 2048
    n_ff: int = 8192
    n_layer: int = 24
    n_head: int = 16
    n_head_kv: int = 4
    n_ctx: int = 2048

    def params(self, n_vocab: int) -> int:
        hd = self.n_embd // self.n_head
        attn = self.n_embd * self.n_embd * 2 + self.n_embd * hd * self.n_head_kv * 2
        return self.n_layer * (3 * self.n_embd * self.n_ff + attn + 2 * self.n_embd) + n_vocab * self.n_embd + self.n_embd


@dataclass(frozen=True)
class Sparsity:
    density: float = 0.10      # mean fraction of neurons active per token
    hot_fraction: float = 0.02  # neurons that fire on most tokens
    hot_frequency: float = 0.85
    spread: float = 1.0         # sigma of the log-normal spread of the other neurons' frequencies
    # gate rows: "lowrank" (rank n_embd/32 plus 15% noise: a low-rank predictor finds them easily) or
    # "context" (full rank, singular values falling as i^-GATE_SPECTRUM_ALPHA as in a trained FFN, so a
    # predictor of rank n_embd/16 sees a fifth of the gate's energy, as on SmolLM2)
    gates: str = "lowrank"

    def frequencies(self, n_ff: int, rng: np.random.Generator) -> np.ndarray:
        n_hot = int(round(self.hot_fraction * n_ff))
        rest = (self.density * n_ff - n_hot * self.hot_frequency) / max(n_ff - n_hot, 1)
        if rest <= 0:
            raise Pi2Error(f"density {self.density} is too low for {self.hot_fraction:.0%} hot neurons at "
                           f"{self.hot_frequency:.0%}")
        f = rng.lognormal(0.0, self.spread, n_ff - n_hot)
        f = np.clip(f * rest / f.mean(), 1e-4, 0.6)
        f *= rest / f.mean()
        freq = np.concatenate([np.full(n_hot, self.hot_frequency), np.clip(f, 1e-4, 0.95)])
        return rng.permutation(freq).astype(np.float32)


def _tokenizer_fields(reader: GGUFReader) -> list[tuple[str, GGUFValueType, Any]]:
    """(key, value type, value) of the tokenizer.* keys to copy into a synthetic model."""
    return [(name, field.types[0], field.contents()) for name, field in reader.fields.items()
            if name.startswith("tokenizer.") and name not in TOKENIZER_KEYS_SKIP]


def _n_vocab(fields: list[tuple[str, GGUFValueType, Any]]) -> int:
    for name, _, val in fields:
        if name == "tokenizer.ggml.tokens":
            return len(val)
    raise Pi2Error("the tokenizer source has no tokenizer.ggml.tokens")


class _Weights:
    """All weights as float32, built layer by layer from a seed (regenerable, so calibration can
    rewrite the gate biases without keeping 1.5B floats in memory)."""

    def __init__(self, shape: Shape, sparsity: Sparsity, n_vocab: int, seed: int) -> None:
        self.shape, self.sparsity, self.n_vocab, self.seed = shape, sparsity, n_vocab, seed
        rng = np.random.default_rng(seed)
        self.freq = [sparsity.frequencies(shape.n_ff, rng) for _ in range(shape.n_layer)]
        self.bias = [np.zeros(shape.n_ff, np.float32) for _ in range(shape.n_layer)]  # set by calibration
        self.resid_const = float(np.sqrt(3.0 * shape.n_embd))  # residual dim 0; others have variance ~1

    def embeddings(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1])
        e = rng.standard_normal((self.n_vocab, self.shape.n_embd), dtype=np.float32)
        e[:, 0] = self.resid_const
        return e

    def layer(self, il: int) -> dict[str, np.ndarray]:
        s = self.shape
        rng = np.random.default_rng([self.seed, 2, il])
        hd = s.n_embd // s.n_head
        n_kv = hd * s.n_head_kv
        sc = 1.0 / np.sqrt(s.n_embd)
        w: dict[str, np.ndarray] = {
            "attn_norm": np.ones(s.n_embd, np.float32),
            "ffn_norm": np.ones(s.n_embd, np.float32),
            "attn_q": rng.standard_normal((s.n_embd, s.n_embd), dtype=np.float32) * sc,
            "attn_k": rng.standard_normal((n_kv, s.n_embd), dtype=np.float32) * sc,
            "attn_v": rng.standard_normal((n_kv, s.n_embd), dtype=np.float32) * sc,
            # outputs stay small next to the residual and never write dimension 0
            "attn_output": rng.standard_normal((s.n_embd, s.n_embd), dtype=np.float32) * (0.3 * sc),
        }
        w["attn_output"][0, :] = 0.0
        if self.sparsity.gates == "context":
            # full rank: Gaussian rows shaped by a power-law spectrum over random orthogonal directions
            q, _ = np.linalg.qr(rng.standard_normal((s.n_embd, s.n_embd)))
            spec = np.arange(1, s.n_embd + 1, dtype=np.float64) ** -GATE_SPECTRUM_ALPHA
            spec *= np.sqrt(s.n_embd / np.sum(spec * spec))  # rows of unit norm on average, as below
            g0 = rng.standard_normal((s.n_ff, s.n_embd), dtype=np.float32)
            gate = ((g0 * spec.astype(np.float32)) @ q.T.astype(np.float32)) / np.float32(np.sqrt(s.n_embd))
        else:
            # low rank (n_embd / 32) plus 15% noise
            r = max(8, s.n_embd // 32)
            u = rng.standard_normal((s.n_ff, r), dtype=np.float32)
            v = rng.standard_normal((r, s.n_embd), dtype=np.float32) / np.sqrt(r * s.n_embd)
            gate = u @ v
            gate += rng.standard_normal(gate.shape, dtype=np.float32) * (0.15 * float(gate.std()))
        gate[:, 0] = self.bias[il]  # column 0: the calibrated bias
        w["ffn_gate"] = gate
        w["ffn_up"] = rng.standard_normal((s.n_ff, s.n_embd), dtype=np.float32) * sc
        down = rng.standard_normal((s.n_embd, s.n_ff), dtype=np.float32) * (2.0 / np.sqrt(s.n_ff * self.sparsity.density))
        down[0, :] = 0.0
        w["ffn_down"] = down
        return w


def write_gguf(path: Path, arch: str, name: str, shape: Any, tok_fields: list, activation: str | None, threshold: float,
               note: str, embeddings: np.ndarray, layers: Callable[[int], dict[str, tuple]], qtype: QT,
               hparams: Callable[[GGUFWriter], None] | None = None, progress: bool = True,
               output: tuple | None = None) -> Path:
    """Writes a synthetic model's GGUF atomically (temp file in the same directory, then rename): shape's
    hyperparameters (n_ctx, n_embd, n_layer, n_ff, n_head, n_head_kv), hparams' own keys, the stated activation
    (None: none stated, the architecture's graph builds it), the tokenizer, an output matrix of its own (output:
    add_tensor arguments; None: tied to the embedding), and layers(il)'s tensors (name suffix -> add_tensor
    arguments; a suffix without a dot is a weight) of every layer."""
    s = shape
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: the rename is atomic
    try:
        gw = GGUFWriter(tmp, arch)
        gw.add_name(name)
        gw.add_context_length(s.n_ctx)
        gw.add_embedding_length(s.n_embd)
        gw.add_block_count(s.n_layer)
        gw.add_feed_forward_length(getattr(s, "n_ff_dense", 0) or s.n_ff)  # deepseek2: its dense layers' FFN
        if hparams is not None:
            hparams(gw)
        gw.add_head_count(s.n_head)
        gw.add_head_count_kv(s.n_head_kv)
        gw.add_rope_dimension_count(getattr(s, "n_rot", 0) or s.n_embd // s.n_head)
        gw.add_layer_norm_rms_eps(1e-5)
        if activation is not None:
            gw.add_string(f"{arch}.ffn_activation", activation)
        if activation == "fatrelu":
            gw.add_float32(f"{arch}.ffn_activation_threshold", threshold)
        gw.add_string(NOTE_KEY, note)
        for key, vtype, val in tok_fields:
            if vtype == GGUFValueType.ARRAY:
                gw.add_array(key, val)
            else:
                gw.add_key_value(key, val, vtype)
        # tensors: small ones F32 (as llama.cpp's converters keep norms), matrices in qtype
        # MXFP4 is an experts' type (gpt-oss): the embedding then Q8_0, as the published files keep it
        embd_type = QT.F16 if qtype == QT.F32 else QT.Q8_0 if qtype == QT.MXFP4 else qtype
        gw.add_tensor("token_embd.weight", *as_tensor(embeddings, embd_type))
        gw.add_tensor("output_norm.weight", np.ones(s.n_embd, np.float32))
        if output is not None:
            gw.add_tensor("output.weight", *output)
        for il in tqdm(range(s.n_layer), desc="write layers", unit="layer", disable=not progress):
            for k, args in layers(il).items():
                gw.add_tensor(f"blk.{il}.{k}" if "." in k else f"blk.{il}.{k}.weight", *args)
        gw.write_header_to_file()
        gw.write_kv_data_to_file()
        gw.write_tensors_to_file(progress=False)
        gw.close()
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_model(path: Path, w: _Weights, tok_fields: list, activation: str, qtype: QT, name: str,
                progress: bool = True, threshold: float = 0.0) -> Path:
    """Writes the GGUF atomically (temp file in the same directory, then rename)."""
    return write_gguf(path, "llama", name, w.shape, tok_fields, activation, threshold,
                      "synthetic model made by pi2-gguf tools/make_model.py: its text is meaningless", w.embeddings(),
                      lambda il: {k: as_tensor(a, qtype) for k, a in w.layer(il).items()}, qtype, progress=progress)


def as_tensor(a: np.ndarray, qtype: QT) -> tuple[np.ndarray, None, QT | None]:
    """(data, raw_shape, raw_dtype) for GGUFWriter.add_tensor: vectors F32, matrices (and stacks of them, one per
    expert) in qtype."""
    if a.ndim == 1 or qtype == QT.F32:
        return np.ascontiguousarray(a, np.float32), None, None
    if qtype == QT.F16:
        return np.ascontiguousarray(a, np.float16), None, None
    if a.ndim == 3:
        q = bundles.quantize_rows(qtype, a.reshape(-1, a.shape[-1]))
        return q.reshape(a.shape[0], a.shape[1], -1), None, qtype
    return bundles.quantize_rows(qtype, a), None, qtype


@dataclass(frozen=True)
class LayerReport:
    target_density: float
    density: float      # measured on held-out text
    hot_share: float    # share of all activations carried by the top hot_fraction of neurons


def _calibrate(w: _Weights, xs: list[np.ndarray], threshold: float = 0.0) -> None:
    """Sets each neuron's bias so that its gate passes threshold (0, or FATReLU's t) on its target fraction
    of the profiled tokens."""
    for il, x16 in enumerate(xs):
        x = x16.astype(np.float32)
        gate = w.layer(il)["ffn_gate"]
        gate[:, 0] = 0.0
        z = x @ gate.T                                   # [T, n_ff] without bias
        zs = np.sort(z, axis=0)
        t = zs.shape[0]
        idx = np.clip(np.floor((1.0 - w.freq[il]) * (t - 1)).astype(int), 0, t - 1)
        cut = zs[idx, np.arange(zs.shape[1])]            # per neuron: z above this on freq of the tokens
        w.bias[il] = ((threshold - cut) / float(np.mean(x[:, 0]))).astype(np.float32)


def _measure(w: _Weights, xs: list[np.ndarray], activation: str, threshold: float = 0.0) -> list[LayerReport]:
    """Per layer: the share of gates that fire (for dReLU a neuron is active only if its up is positive
    too, about half of those)."""
    out = []
    for il, x16 in enumerate(xs):
        x = x16.astype(np.float32)
        g = x @ w.layer(il)["ffn_gate"].T
        active = g > threshold if activation in ("relu", "drelu", "fatrelu") else np.abs(g / (1 + np.exp(-g))) > 0.1
        per_neuron = active.sum(axis=0)
        top = np.sort(per_neuron)[::-1][: max(1, int(round(w.sparsity.hot_fraction * per_neuron.size)))]
        out.append(LayerReport(float(w.freq[il].mean()), float(active.mean()),
                               float(top.sum() / max(per_neuron.sum(), 1))))
    return out


def make(path: str | Path, shape: Shape, sparsity: Sparsity, activation: str = "relu", qtype: QT = QT.Q4_K,
         seed: int = 0, tokenizer_from: str | Path | None = None, text: str | Path | None = None,
         calib_tokens: int = 512, heldout_tokens: int = 256, max_rounds: int = 6,
         density_tolerance: float = 0.05, threads: int | None = None,
         progress: bool = True, threshold: float = FATRELU_THRESHOLD) -> list[LayerReport]:
    """Writes a synthetic model to path; returns per-layer densities measured on held-out text."""
    from ..assets import corpus as corpus_mod
    from ..assets import models
    from .profile import run_profile

    if activation not in ACTIVATIONS:
        raise Pi2Error(f"activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
    if sparsity.gates not in GATE_MODES:
        raise Pi2Error(f"gate mode '{sparsity.gates}' is not one of {', '.join(GATE_MODES)}")
    if not (np.isfinite(threshold) and threshold >= 0):
        raise Pi2Error(f"the FATReLU threshold must be finite and >= 0, got {threshold}")
    t = threshold if activation == "fatrelu" else 0.0
    if shape.n_embd % shape.n_head or (shape.n_embd // shape.n_head) % 2:
        raise Pi2Error(f"n_embd {shape.n_embd} must split into {shape.n_head} heads of even size")
    if qtype not in (QT.F32, QT.F16) and shape.n_embd % bundles.GGML_QUANT_SIZES[qtype][0]:
        raise Pi2Error(f"{qtype.name} rows need a multiple of {bundles.GGML_QUANT_SIZES[qtype][0]} values; n_embd is {shape.n_embd}")
    if not 0.0 < sparsity.density < 1.0:
        raise Pi2Error(f"density must be in (0, 1), got {sparsity.density}")
    if max_rounds < 1:
        raise Pi2Error(f"max_rounds must be at least 1, got {max_rounds}")
    out = Path(path)
    if not out.parent.is_dir():
        raise Pi2Error(f"output directory {out.parent} does not exist")
    tok_src = Path(tokenizer_from) if tokenizer_from is not None else models.fetch(models.DEFAULT_MODEL, progress)
    tok_fields = _tokenizer_fields(GGUFReader(tok_src, "r"))
    w = _Weights(shape, sparsity, _n_vocab(tok_fields), seed)
    name = f"pi2-synthetic-{activation}-{sparsity.gates}-{shape.n_layer}x{shape.n_embd}x{shape.n_ff}-d{sparsity.density:g}"
    corpus = corpus_mod.load(text)
    # Calibrating layer i moves the inputs of every later layer, so a round's biases are set on inputs
    # the next round changes: with two rounds a 16-layer model ended at 0.10 in its first layers and
    # 0.17-0.20 in its last. Rounds go on until the calibration tokens, run through the model as
    # written, give every layer its density within density_tolerance (relative).
    write_model(out, w, tok_fields, activation, qtype, name, progress, t)
    for r in range(max_rounds + 1):
        prof = run_profile(out, corpus, calib_tokens, 16, threads=threads, progress=progress)
        if r > 0:
            worst = max(abs(x.density - x.target_density) / x.target_density
                        for x in _measure(w, prof.train, activation, t))
            if progress:
                tqdm.write(f"calibration round {r}: densities within {worst:.1%} of the target")
            if worst <= density_tolerance or r == max_rounds:
                break
        _calibrate(w, prof.train, t)
        write_model(out, w, tok_fields, activation, qtype, name, progress, t)
    prof = run_profile(out, corpus, 64, heldout_tokens, threads=threads, progress=progress)
    return _measure(w, prof.heldout, activation, t)
