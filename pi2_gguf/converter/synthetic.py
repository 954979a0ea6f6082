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

stats "real" (make_model's default) is calibrated in one pass instead, the model written once (_make_real): numpy runs
llama's forward over the calibration text on the weights as quantized, layer by layer, and each layer is
calibrated on its FFN inputs once the layers before it are final; the model as written is then profiled through
llama.cpp once, to check the calibration and to report on held-out text. A 32-layer 4096 x 14336 Q4_K model (4 GB)
was made so in 15.5 minutes on 2 cores, where the rounds took 11 minutes for a 0.39 GB one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tqdm import tqdm

from ..errors import Pi2Error
from . import activation_stats, bundles
from .gaussian_weights import DIRECT_TYPES, GaussianMatrix, Weight, as_array
from .activation_stats import ActivationStats

ACTIVATIONS = ("relu", "drelu", "fatrelu", "silu")
GATE_MODES = ("lowrank", "context")
# "uniform": neurons' firing frequencies as Sparsity.frequencies draws them (a few hot, the rest log-normal), tokens
# independent; "real": as published models' (a Beta propensity per neuron, a layer profile, persistence over tokens)
STATS_MODES = ("uniform", "real")
# stats "real" [fit] (TurboSparse-Mistral-7B-like, fitted to PowerInfer arXiv 2312.12456 and PowerInfer-2 arXiv
# 2406.06282 figures): propensity p ~ Beta(mu c, (1 - mu) c) with mu the layer's active fraction, c 4; the first two
# layers ~0.15 active, the last ~0.20, the middle 0.07-0.10 (at a mean of 0.10: scaled with --density); and a lag-1
# autocorrelation of each neuron's on/off series of 0.4, which LLM in a Flash's (arXiv 2312.11514) 5-token union
# reproduces (24% of the FFN holding ~76% of the next token's neurons)
REAL_CONCENTRATION = 4.0
REAL_PHI = 0.4
CONTEXT_DIMS_DIV = 8  # stats "real": n_embd / this residual dimensions carry context (written by attention only)
# stats "real": attention heads' memory, in tokens: a head's queries read the RoPE pairs of frequency <= 1 / L and
# its scores fall with distance so that about L recent tokens share its average (cycled over the heads)
REAL_HEAD_MEMORY = (2.0, 4.0)
WALK_TOKENS = 4096  # stats "real": the output layer's walk, distinct tokens of real text in order of first appearance
# SmolLM2-135M's ffn_gate singular values fall as i^-0.40 to i^-0.48 (layers 3, 15, 27; fit over i >= 5),
# and its top n_embd/16 directions hold 20-24% of the energy
GATE_SPECTRUM_ALPHA = 0.45
FATRELU_THRESHOLD = 0.01  # ProSparse's FATReLU threshold
TOKENIZER_KEYS_SKIP = ("tokenizer.chat_template",)
# the model file's own note of how it was made (a key of the synthetic model, not of a sidecar)
NOTE_KEY = "pi2.synthetic.note"
SYNTHETIC_NOTE = "synthetic model made by pi2-gguf tools/make_model.py: its text is meaningless"
RMS_EPS = 1e-5     # the models' norm epsilon
ROPE_BASE = 10000.0  # llama.cpp's RoPE frequency base when a GGUF states none (these do not)


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
    stats: str = "uniform"  # STATS_MODES

    def layer_density(self, il: int, n_layer: int) -> float:
        """stats "real": layer il's mean active fraction, TurboSparse-Mistral-7B's profile scaled to this density:
        the first two layers 1.5x, the last 2x, the middle rising from 0.7x to 1.0x."""
        if il == n_layer - 1 and n_layer > 1:
            f = 2.0
        elif il < 2:
            f = 1.5
        else:
            mid = max(n_layer - 3, 1)
            f = 0.7 + 0.3 * (il - 2) / max(mid - 1, 1)
        return min(self.density * f, 0.5)

    def real_frequencies(self, n_ff: int, mu: float, rng: np.random.Generator,
                         concentration: float = REAL_CONCENTRATION) -> np.ndarray:
        """stats "real": each neuron's firing propensity ~ Beta(mu c, (1 - mu) c)."""
        f = rng.beta(mu * concentration, (1.0 - mu) * concentration, n_ff)
        return np.clip(f, 1e-4, 0.95).astype(np.float32)

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
        self.real = sparsity.stats == "real"
        if self.real:
            self.freq = [sparsity.real_frequencies(shape.n_ff, sparsity.layer_density(il, shape.n_layer),
                                                   np.random.default_rng([seed, 6, il])) for il in range(shape.n_layer)]
        else:
            rng = np.random.default_rng(seed)
            self.freq = [sparsity.frequencies(shape.n_ff, rng) for _ in range(shape.n_layer)]
        self.bias = [np.zeros(shape.n_ff, np.float32) for _ in range(shape.n_layer)]  # set by calibration
        self.resid_const = float(np.sqrt(3.0 * shape.n_embd))  # residual dim 0; others have variance ~1
        self.n_ctx_dims = max(1, shape.n_embd // CONTEXT_DIMS_DIV)
        # stats "real": per layer the gate's scale on the token dimensions and on the context dimensions (set by
        # calibration to give the target persistence)
        self.mix = [(1.0, 0.5) for _ in range(shape.n_layer)]
        self.walk: list[int] | None = None  # stats "real": the output layer's cycle of tokens
        # gate columns 1..bias_block-1 zero, so that the bias (column 0) has its quantization block to itself:
        # sharing a Q4_K block's 4-bit grid with 31 weights of its size, it was 29% off what calibration set
        self.bias_block = 1
        # stats "real" in a 4-bit type (gaussian_weights.DIRECT_TYPES; set by the maker): up and down drawn as codes
        # when written; else drawn in the layer's stream, as every model before
        self.codes = False

    def embeddings(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1])
        e = rng.standard_normal((self.n_vocab, self.shape.n_embd), dtype=np.float32)
        e[:, 0] = self.resid_const
        if self.real:
            e[:, 1:1 + self.n_ctx_dims] = 0.0  # context dimensions: attention writes them
        return e

    def output(self, embeddings: np.ndarray) -> np.ndarray | None:
        """stats "real": an output matrix whose greedy pick after token walk[i] is walk[i + 1] (a cycle): row
        walk[i + 1] is walk[i]'s embedding on the token dimensions, and every token off the cycle gets a large
        negative logit from the constant dimension 0. None: tied to the embedding."""
        if self.walk is None:
            return None
        return walk_output(embeddings, self.walk, 1 + self.n_ctx_dims)

    def ctx_gate(self, il: int) -> np.ndarray:
        """stats "real": the gate's columns on the context dimensions [n_ff, m], before the layer's scale."""
        rng = np.random.default_rng([self.seed, 7, il])
        c = rng.standard_normal((self.shape.n_ff, self.n_ctx_dims), dtype=np.float32)
        c[:, :self.bias_block - 1] = 0.0  # residual dimensions 1..bias_block-1 (set_gate)
        return c

    def _real_attention(self, il: int, w: dict[str, Weight]) -> None:
        """stats "real": attention that carries context. Queries and keys read the constant dimension 0 alone, so
        a score depends on the distance between positions only (RoPE); a head's queries read only the rotary
        pairs of frequency <= 1 / L, so its softmax spreads over about the L last tokens. Values read the token
        dimensions; the output writes the context dimensions alone (and the FFN never does): they hold
        recency-weighted means of recent tokens, a slowly varying part of every later FFN's input."""
        s, m = self.shape, self.n_ctx_dims
        rng = np.random.default_rng([self.seed, 5, il])
        hd = s.n_embd // s.n_head
        x0 = float(np.sqrt(0.75 * s.n_embd))  # dimension 0 after the norm
        theta = 10000.0 ** (-np.arange(0, hd, 2) / hd)
        q = np.zeros((s.n_embd, s.n_embd), np.float32)
        k = np.zeros((hd * s.n_head_kv, s.n_embd), np.float32)
        k[:, 0] = 1.0 / x0
        o = np.zeros((s.n_embd, s.n_embd), np.float32)
        for h in range(s.n_head):
            mem = REAL_HEAD_MEMORY[h % len(REAL_HEAD_MEMORY)]
            sel = np.repeat(theta <= 1.0 / mem, 2)  # llama's RoPE rotates pairs of adjacent dimensions
            amp, keff = _head_amplitude(theta[theta <= 1.0 / mem], mem)
            # score(d) = (2 a_q a_k / sqrt(hd)) sum cos(theta d) with a_k 1: a_q = amp sqrt(hd) / 2
            q[h * hd:(h + 1) * hd, 0] = np.where(sel, amp * np.sqrt(hd) / 2.0 / x0, 0.0)
            o[1:1 + m, h * hd:(h + 1) * hd] = rng.standard_normal((m, hd), dtype=np.float32) * np.float32(
                np.sqrt(keff / (0.22 * hd * s.n_head)))
        v = np.zeros((hd * s.n_head_kv, s.n_embd), np.float32)
        v[:, 1 + m:] = rng.standard_normal((hd * s.n_head_kv, s.n_embd - 1 - m), dtype=np.float32) / np.float32(
            np.sqrt(s.n_embd))
        w["attn_q"], w["attn_k"], w["attn_v"], w["attn_output"] = q, k, v, o

    def set_gate(self, il: int, gate: np.ndarray) -> None:
        """Puts layer il's calibration into its gate rows as layer() generates them at the mix (1, 0) and bias 0:
        column 0 the bias; stats "real": the token dimensions scaled by the mix's token part, the context
        dimensions its context part times ctx_gate."""
        gate[:, 0] = self.bias[il]  # column 0: the calibrated bias
        if self.real:
            m = self.n_ctx_dims
            a_tok, a_ctx = self.mix[il]
            gate[:, 1 + m:] *= np.float32(a_tok)
            gate[:, 1:1 + m] = self.ctx_gate(il) * np.float32(a_ctx)
        gate[:, 1:self.bias_block] = 0.0

    def layer(self, il: int) -> dict[str, Weight]:
        s = self.shape
        rng = np.random.default_rng([self.seed, 2, il])
        hd = s.n_embd // s.n_head
        n_kv = hd * s.n_head_kv
        sc = 1.0 / np.sqrt(s.n_embd)
        w: dict[str, Weight] = {
            "attn_norm": np.ones(s.n_embd, np.float32),
            "ffn_norm": np.ones(s.n_embd, np.float32),
            "attn_q": rng.standard_normal((s.n_embd, s.n_embd), dtype=np.float32) * sc,
            "attn_k": rng.standard_normal((n_kv, s.n_embd), dtype=np.float32) * sc,
            "attn_v": rng.standard_normal((n_kv, s.n_embd), dtype=np.float32) * sc,
        }
        # outputs stay small next to the residual and never write dimension 0
        wo = rng.standard_normal((s.n_embd, s.n_embd), dtype=np.float32) * (0.3 * sc)
        wo[0, :] = 0.0
        w["attn_output"] = wo
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
        self.set_gate(il, gate)
        w["ffn_gate"] = gate
        if self.codes:
            self._real_attention(il, w)
            # up and down: iid draws nothing calibrates, drawn when written, straight as 4-bit codes (gaussian_weights);
            # down never writes dimension 0 or the context dimensions
            w["ffn_up"] = GaussianMatrix((s.n_ff, s.n_embd), sc, (self.seed, 3, il, 0))
            sd_down = 2.0 / np.sqrt(s.n_ff * float(self.freq[il].mean()))
            w["ffn_down"] = GaussianMatrix((s.n_embd, s.n_ff), sd_down, (self.seed, 3, il, 1), zero_rows=1 + self.n_ctx_dims)
            return w
        w["ffn_up"] = rng.standard_normal((s.n_ff, s.n_embd), dtype=np.float32) * sc
        down = rng.standard_normal((s.n_embd, s.n_ff), dtype=np.float32) * (2.0 / np.sqrt(s.n_ff * self.sparsity.density))
        down[0, :] = 0.0
        w["ffn_down"] = down
        if self.real:
            m = self.n_ctx_dims
            self._real_attention(il, w)
            down *= np.float32(np.sqrt(self.sparsity.density / float(self.freq[il].mean())))
            down[1:1 + m, :] = 0.0  # the FFN never writes the context dimensions
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
        # use_temp_file: each tensor goes to a spool file as it is added, so a model larger than RAM is written
        # without holding its tensors (a 12-17 GB MoE model)
        gw = GGUFWriter(tmp, arch, use_temp_file=True)
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
        gw.add_layer_norm_rms_eps(RMS_EPS)
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
        gw.add_tensor("token_embd.weight", *as_tensor(embeddings, _embd_type(qtype)))
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


def patch_tensors(path: Path, tensors: Iterable[tuple[str, tuple]]) -> None:
    """Overwrites tensors of a GGUF in place ((name, add_tensor arguments) pairs, taken one at a time so a generator
    holds one layer's at once; the file is opened once), each the same type and size as the one it replaces:
    calibration changes a few tensors (routers; sparse experts' gates) of a model too large to write again each
    round. Not atomic: the caller patches a file it has not yet renamed into place."""
    reader = GGUFReader(path, "r+")
    by_name = {t.name: t for t in reader.tensors}
    for name, (data, _raw_shape, raw_dtype) in tensors:
        t = by_name.get(name)
        if t is None:
            raise Pi2Error(f"{path} has no tensor {name} to patch")
        want = QT.F32 if raw_dtype is None and data.dtype == np.float32 else \
            QT.F16 if raw_dtype is None and data.dtype == np.float16 else raw_dtype
        if t.tensor_type != want or t.data.nbytes != data.nbytes:
            raise Pi2Error(f"{path}: tensor {name} is {t.tensor_type.name} of {t.data.nbytes} bytes; the patch is "
                           f"{want.name if want is not None else data.dtype} of {data.nbytes}")
        t.data.reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    reader.data.flush()
    del reader


def _embd_type(qtype: QT) -> QT:
    """The token embedding's type in a model of matrices in qtype."""
    return QT.F16 if qtype == QT.F32 else QT.Q8_0 if qtype == QT.MXFP4 else qtype


def walk_output(embeddings: np.ndarray, walk: list[int], first_token_dim: int) -> np.ndarray:
    """An output matrix whose greedy pick after token walk[i] is walk[i + 1] (walk[0] after the last): row
    walk[i + 1] is walk[i]'s embedding on the token dimensions (first_token_dim on), and every token off the walk
    gets a negative logit from the constant dimension 0, so a decode fed no text still varies its tokens."""
    n = embeddings.shape[1]
    out = np.zeros_like(embeddings)
    out[:, 0] = -2.0 / np.sqrt(n)  # times the normed x_0 (~sqrt(3n)/2): about -sqrt(3)
    cyc = np.asarray(walk, np.int64)
    nxt = np.roll(cyc, -1)
    out[nxt, 0] = 0.0
    out[nxt, first_token_dim:] = embeddings[cyc, first_token_dim:] / np.float32(np.sqrt(n))
    return out


def _head_amplitude(theta: np.ndarray, memory: float, n: int = 4096) -> tuple[float, float]:
    """(A, effective tokens) for a head whose scores are A sum_i cos(theta_i d) at distance d: the A whose softmax
    over distances 0..n spreads over `memory` tokens (1 / sum of squared weights), by bisection."""
    d = np.arange(n, dtype=np.float64)
    base = np.cos(np.outer(d, theta)).sum(axis=1)
    base -= base[0]

    def keff(a: float) -> float:
        wt = np.exp(a * base)
        wt /= wt.sum()
        return float(1.0 / np.sum(wt * wt))

    lo, hi = 0.05, 64.0
    for _ in range(40):
        mid = np.sqrt(lo * hi)
        if keff(mid) > memory:
            lo = mid
        else:
            hi = mid
    a = float(np.sqrt(lo * hi))
    return a, keff(a)


def write_model(path: Path, w: _Weights, tok_fields: list, activation: str, qtype: QT, name: str,
                progress: bool = True, threshold: float = 0.0) -> Path:
    """Writes the GGUF atomically (temp file in the same directory, then rename)."""
    embeddings = w.embeddings()
    out = w.output(embeddings)
    return write_gguf(path, "llama", name, w.shape, tok_fields, activation, threshold, SYNTHETIC_NOTE, embeddings,
                      lambda il: {k: as_tensor(a, qtype) for k, a in w.layer(il).items()}, qtype, progress=progress,
                      output=None if out is None else as_tensor(out, QT.F16 if qtype == QT.F32 else qtype))


def as_tensor(a: Weight, qtype: QT) -> tuple[np.ndarray, None, QT | None]:
    """(data, raw_shape, raw_dtype) for GGUFWriter.add_tensor: vectors F32, matrices (and stacks of them, one per
    expert) in qtype; a GaussianMatrix drawn straight in qtype where it can be."""
    if isinstance(a, GaussianMatrix):
        if qtype in DIRECT_TYPES:
            return a.quantized(qtype), None, qtype
        a = a.values()
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
    # skew, persistence and cache hit rates on held-out text, the hot ranking from the calibration text
    stats: ActivationStats | None = None
    target_overlap: float | None = None  # stats "real": the lag-1 overlap calibration aimed at
    # stats "real": the density and lag-1 overlap on the calibration text through llama.cpp (the model as written),
    # the check of the calibration done on numpy's forward
    calib_density: float | None = None
    calib_overlap: float | None = None


def target_overlap(freq: np.ndarray, phi: float = REAL_PHI) -> float:
    """The lag-1 overlap (of a token's active neurons, the share active on the token before) of two-state Markov
    neurons of these propensities and lag-1 autocorrelation phi: E[p (p + phi (1 - p))] / E[p]."""
    p = freq.astype(np.float64)
    return float(np.sum(p * (p + phi * (1.0 - p))) / np.sum(p))


def _active(z: np.ndarray, activation: str, threshold: float) -> np.ndarray:
    return z > threshold if activation in ("relu", "drelu", "fatrelu") else np.abs(z / (1 + np.exp(-z))) > 0.1


def _calibrate_real(w: _Weights, il: int, x: np.ndarray, gate: np.ndarray, window: int,
                    threshold: float = 0.0) -> None:
    """stats "real": layer il's mix of token and context dimensions in the gate rows whose firing has the target
    lag-1 overlap (bisection), and each neuron's bias for its target frequency at that mix, on the layer's FFN
    inputs x [n_tokens, n_embd] (consecutive text in windows of `window` tokens). gate: the layer's gate rows as
    layer() makes them at the mix (1, 0) and bias 0 (the token dimensions alone)."""
    m = w.n_ctx_dims
    z_tok = x @ gate.T
    z_ctx = x[:, 1:1 + m] @ w.ctx_gate(il).T
    s_tok, s_ctx = float(z_tok.std()) or 1.0, float(z_ctx.std()) or 1.0
    target = target_overlap(w.freq[il])

    # a neuron fires iff bias x_0 + z > threshold, i.e. (z - threshold) / x_0 > -bias: its bias is then one cut of
    # these per neuron, right on every token however x_0 varies (with depth the RMS norm makes it vary by 10-20%
    # in a drelu model, and a cut of z at the mean x_0 left layers 5-13% above their densities)
    x0 = x[:, :1]

    def fire(lam: float) -> tuple[np.ndarray, np.ndarray]:
        u = (np.sqrt(1.0 - lam * lam) / s_tok * z_tok + lam / s_ctx * z_ctx - threshold) / x0
        cut = _cuts(u, w.freq[il])
        return u > cut, cut

    lo, hi = 0.0, 0.995
    for _ in range(8):
        mid = 0.5 * (lo + hi)
        if activation_stats.lag1_overlap(fire(mid)[0], window) < target:
            lo = mid
        else:
            hi = mid
    lam = 0.5 * (lo + hi)
    w.mix[il] = (float(np.sqrt(1.0 - lam * lam) / s_tok), float(lam / s_ctx))
    w.bias[il] = (-fire(lam)[1]).astype(np.float32)


def _cuts(z: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Per neuron, the value its pre-activations z [n_tokens, n_ff] exceed on its propensity freq of the tokens.
    A propensity below a few firings in the text: the cut from the normal tail of the neuron's pre-activations
    (the sample quantile would make it fire about once in n_tokens, whatever its target)."""
    from .synthetic_moe import _inv_norm_cdf

    t = z.shape[0]
    idx = np.clip(np.floor((1.0 - freq) * (t - 1)).astype(int), 0, t - 1)
    cut = np.sort(z, axis=0)[idx, np.arange(z.shape[1])]
    rare = freq * t < 8
    zr = z[:, rare]
    cut[rare] = zr.mean(axis=0) + zr.std(axis=0) * _inv_norm_cdf(1.0 - freq[rare].astype(np.float64)).astype(np.float32)
    return cut


def _quantized_gate(w: _Weights, il: int, x: np.ndarray, gate: np.ndarray, qtype: QT,
                    threshold: float) -> tuple[np.ndarray, None, QT | None]:
    """Layer il's gate (calibrated, w.set_gate) quantized, its bias column corrected for the quantization: the
    cuts again on x [n_tokens, n_embd] through the quantized rows, and the bias set so that its quantized value
    is the one they ask for (its block's scale is quantized, to 6 bits of the super-block's in the K-quants)."""
    q = as_tensor(gate, qtype)
    if q[2] is None:  # F32 and F16: the bias as set (F16's rounding is ~1e-3 of it)
        return q
    k = gate.shape[1]
    g = _values(q, k)
    x0 = x[:, :1]
    u = (x @ g.T - x0 * g[:, 0] - threshold) / x0  # the pre-activations without the bias term, as _calibrate_real's
    want = (-_cuts(u, w.freq[il])).astype(np.float32)
    # rows split into blocks that quantize alone: the first block's values, quantized alone, are the file's
    block = bundles.GGML_QUANT_SIZES[qtype][0]
    head = np.array(gate[:, :block])
    b = want.copy()
    for _ in range(4):
        head[:, 0] = b
        b += want - _values(as_tensor(head, qtype), block)[:, 0]
    gate[:, 0] = b
    w.bias[il] = b  # layer() regenerates the gate as written
    return as_tensor(gate, qtype)


def _calibrate(w: _Weights, xs: list[np.ndarray], threshold: float = 0.0) -> None:
    """Sets each neuron's bias so that its gate passes threshold (0, or FATReLU's t) on its target fraction
    of the profiled tokens."""
    for il, x16 in enumerate(xs):
        x = x16.astype(np.float32)
        gate = as_array(w.layer(il)["ffn_gate"])
        gate[:, 0] = 0.0
        z = x @ gate.T                                   # [T, n_ff] without bias
        zs = np.sort(z, axis=0)
        t = zs.shape[0]
        idx = np.clip(np.floor((1.0 - w.freq[il]) * (t - 1)).astype(int), 0, t - 1)
        cut = zs[idx, np.arange(zs.shape[1])]            # per neuron: z above this on freq of the tokens
        w.bias[il] = ((threshold - cut) / float(np.mean(x[:, 0]))).astype(np.float32)


def _measure(w: _Weights, xs: list[np.ndarray], activation: str, threshold: float = 0.0,
             window: int | None = None, ranked: list[np.ndarray] | None = None,
             gates: Callable[[int], np.ndarray] | None = None) -> list[LayerReport]:
    """Per layer: the share of gates that fire (for dReLU a neuron is active only if its up is positive
    too, about half of those). With window (tokens of consecutive text in xs), also the activation statistics
    (activation_stats), the static hot set ranked by `ranked`'s inputs (other text; default: these).
    gates: layer il's gate rows (default: w's, as generated)."""
    out = []
    for il, x16 in enumerate(xs):
        x = x16.astype(np.float32)
        gate = gates(il) if gates is not None else as_array(w.layer(il)["ffn_gate"])
        active = _active(x @ gate.T, activation, threshold)
        per_neuron = active.sum(axis=0)
        top = np.sort(per_neuron)[::-1][: max(1, int(round(w.sparsity.hot_fraction * per_neuron.size)))]
        st = None
        if window is not None:
            rank = None
            if ranked is not None:
                counts = _active(ranked[il].astype(np.float32) @ gate.T, activation, threshold).sum(axis=0)
                rank = np.argsort(-counts, kind="stable")
            st = activation_stats.activation_stats(active, rank, window)
        out.append(LayerReport(float(w.freq[il].mean()), float(active.mean()),
                               float(top.sum() / max(per_neuron.sum(), 1)), st,
                               target_overlap(w.freq[il]) if w.real else None))
    return out


def make(path: str | Path, shape: Shape, sparsity: Sparsity, activation: str = "relu", qtype: QT = QT.Q4_K,
         seed: int = 0, tokenizer_from: str | Path | None = None, text: str | Path | None = None,
         calib_tokens: int = 512, heldout_tokens: int = 256, max_rounds: int = 6,
         density_tolerance: float = 0.05, threads: int | None = None,
         progress: bool = True, threshold: float = FATRELU_THRESHOLD) -> list[LayerReport]:
    """Writes a synthetic model to path; returns per-layer densities measured on held-out text. stats "uniform":
    calibrated in rounds through llama.cpp (max_rounds, density_tolerance); "real": in one pass (_make_real)."""
    from ..assets import corpus as corpus_mod
    from ..assets import models
    from .profile import run_profile

    if activation not in ACTIVATIONS:
        raise Pi2Error(f"activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
    if sparsity.gates not in GATE_MODES:
        raise Pi2Error(f"gate mode '{sparsity.gates}' is not one of {', '.join(GATE_MODES)}")
    if sparsity.stats not in STATS_MODES:
        raise Pi2Error(f"stats '{sparsity.stats}' is not one of {', '.join(STATS_MODES)}")
    if sparsity.stats == "real" and shape.n_embd // CONTEXT_DIMS_DIV < 4:
        raise Pi2Error(f"stats real needs n_embd of 32 or more (context dimensions), got {shape.n_embd}")
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
    w.codes = w.real and qtype in DIRECT_TYPES
    name = f"pi2-synthetic-{activation}-{sparsity.gates}-{shape.n_layer}x{shape.n_embd}x{shape.n_ff}-d{sparsity.density:g}"
    if w.real:
        name += "-real"
    corpus = corpus_mod.load(text)
    if w.real:
        return _make_real(out, w, tok_src, tok_fields, corpus, activation, qtype, name, t, calib_tokens,
                          heldout_tokens, threads, progress)
    # stats uniform (tests pin these models' bytes, so they are still made this way): calibrating layer i moves
    # the inputs of every later layer, so a round's biases are set on inputs the next round changes: with two
    # rounds a 16-layer model ended at 0.10 in its first layers and 0.17-0.20 in its last. Rounds go on until the
    # calibration tokens, run through the model as written, give every layer its density within
    # density_tolerance (relative).
    write_model(out, w, tok_fields, activation, qtype, name, progress, t)
    for r in range(max_rounds + 1):
        prof = run_profile(out, corpus, calib_tokens, 16, threads=threads, progress=progress)
        if r > 0:
            got = _measure(w, prof.train, activation, t)
            worst = max(abs(x.density - x.target_density) / x.target_density for x in got)
            if progress:
                tqdm.write(f"calibration round {r}: densities within {worst:.1%} of the target")
            if worst <= density_tolerance or r == max_rounds:
                break
        _calibrate(w, prof.train, t)
        write_model(out, w, tok_fields, activation, qtype, name, progress, t)
    calib_inputs = prof.train
    prof = run_profile(out, corpus, 64, heldout_tokens, threads=threads, progress=progress)
    return _measure(w, prof.heldout, activation, t, prof.window, calib_inputs)


def _rms_norm(x: np.ndarray) -> np.ndarray:
    """llama's RMS norm (the norm weights of a synthetic model are ones)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(RMS_EPS))


def _attention(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, wo: np.ndarray, n_head: int,
               n_head_kv: int) -> np.ndarray:
    """llama's self-attention output over one window of consecutive tokens from position 0 (x: the normed inputs
    [n_tokens, n_embd]), as llama.cpp computes it: RoPE on adjacent pairs of every head dimension (base
    ROPE_BASE), causal softmax of the scores scaled by 1/sqrt(head size), query head h reading KV head
    h // (n_head / n_head_kv)."""
    t = x.shape[0]
    hd = wq.shape[0] // n_head
    theta = ROPE_BASE ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(t, dtype=np.float64)[:, None] * theta[None, :]
    cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]

    def rope(v: np.ndarray) -> np.ndarray:  # [t, heads, hd]
        a, b = v[..., 0::2], v[..., 1::2]
        r = np.empty_like(v)
        r[..., 0::2] = a * cos - b * sin
        r[..., 1::2] = a * sin + b * cos
        return r

    g = n_head // n_head_kv
    q = rope((x @ wq.T).reshape(t, n_head, hd)).transpose(1, 0, 2)                       # [h, t, hd]
    k = np.repeat(rope((x @ wk.T).reshape(t, n_head_kv, hd)), g, axis=1).transpose(1, 2, 0)  # [h, hd, t]
    v = np.repeat((x @ wv.T).reshape(t, n_head_kv, hd), g, axis=1).transpose(1, 0, 2)   # [h, t, hd]
    sc = (q @ k) * np.float32(1.0 / np.sqrt(hd))
    sc = np.where(np.tri(t, dtype=bool), sc, -np.inf)
    sc -= sc.max(axis=-1, keepdims=True)
    pr = np.exp(sc)
    pr /= pr.sum(axis=-1, keepdims=True)
    return (pr @ v).transpose(1, 0, 2).reshape(t, n_head * hd) @ wo.T


def _values(t: tuple[np.ndarray, None, QT | None], k: int) -> np.ndarray:
    """The float32 matrix [rows, k] llama.cpp computes with for an as_tensor result (quantized: dequantized)."""
    data, _, qt = t
    return np.asarray(data, np.float32) if qt is None else bundles.dequantize_rows(qt, data, k)


def _written_gates(path: Path) -> Callable[[int], np.ndarray]:
    """Layer il's ffn_gate as the GGUF at path holds it, as float32 (dequantized)."""
    tensors = {t.name: t for t in GGUFReader(path, "r").tensors}

    def gate(il: int) -> np.ndarray:
        t = tensors[f"blk.{il}.ffn_gate.weight"]
        k = int(t.shape[0])  # gguf-py lists ne0 (the row length) first
        qt = QT(t.tensor_type)
        data = np.asarray(t.data)
        return np.asarray(data, np.float32) if qt in (QT.F32, QT.F16) else bundles.dequantize_rows(qt, data, k)
    return gate


def _make_real(out: Path, w: _Weights, tok_src: Path, tok_fields: list, corpus: Any, activation: str, qtype: QT,
               name: str, threshold: float, calib_tokens: int, heldout_tokens: int, threads: int | None,
               progress: bool) -> list[LayerReport]:
    """stats "real" in one pass, the model written once: the calibration text run through the model in numpy
    (llama's forward on the weights as quantized, _attention and the stated activation), layer by layer, each
    layer calibrated (_calibrate_real) on its FFN inputs once the layers before it are final, so that no later
    change moves them. Rounds of writing the whole model and profiling it through llama.cpp did the same in up
    to 7 passes (an 8-layer 0.39 GB dReLU model took 11 minutes; one write of a 4 GB Q4_K model alone takes ~7);
    in one pass a 32-layer 4 GB model took 15.5 minutes on 2 cores.
    The model as written is then profiled through llama.cpp once, on the calibration text (the static hot set's
    ranking, and a check of the calibration) and on held-out text (the report)."""
    from ..runtime.runner import LlamaRunner
    from .model_ffn import activation_values, up_values
    from .profile import DEFAULT_WINDOW, run_profile

    s = w.shape
    window = min(DEFAULT_WINDOW, s.n_ctx)  # run_profile's window, capped to the model's context as it caps it
    # the tokenizer source tokenizes as the model will (its tokenizer keys are copied), so the windows are the
    # ones run_profile hands the written model
    with LlamaRunner(tok_src, n_ctx=window) as r:
        wins = [np.asarray(x, np.int64) for x in r.windows(corpus.split()[0], calib_tokens)]
    if sum(x.size for x in wins) < 64:
        raise Pi2Error(f"the corpus {corpus.name} gives only {sum(x.size for x in wins)} calibration tokens (64 at least)")
    w.walk = walk_tokens(tok_src, corpus, min(WALK_TOKENS, w.n_vocab))
    embeddings = w.embeddings()
    # rows quantize independently: the rows the text uses, quantized alone, are the file's rows
    used = np.unique(np.concatenate(wins))
    rows = _values(as_tensor(embeddings[used], _embd_type(qtype)), s.n_embd)
    h = [rows[np.searchsorted(used, x)] for x in wins]  # per window, the residual stream [tokens, n_embd]
    # the bias's block: 32 columns (the scales' sub-block of the K-quants, the block of Q8_0, Q4_0, MXFP4)
    w.bias_block = 1 if qtype in (QT.F32, QT.F16) else min(32, bundles.GGML_QUANT_SIZES[qtype][0])
    layers: list[dict[str, tuple]] = []
    for il in tqdm(range(s.n_layer), desc="calibrate and quantize layers", unit="layer", disable=not progress):
        w.mix[il] = (1.0, 0.0)  # the gate on the token dimensions alone until _calibrate_real sets the mix
        f = w.layer(il)
        gate = as_array(f["ffn_gate"])
        q = {k: as_tensor(a, qtype) for k, a in f.items() if k != "ffn_gate"}
        wq, wk, wv, wo = (_values(q[k], s.n_embd) for k in ("attn_q", "attn_k", "attn_v", "attn_output"))
        for x in h:
            x += _attention(_rms_norm(x), wq, wk, wv, wo, s.n_head, s.n_head_kv)
        xin = _rms_norm(np.concatenate(h))  # the FFN inputs (llama.cpp's ffn_norm)
        _calibrate_real(w, il, xin, gate, window, threshold)
        w.set_gate(il, gate)
        q["ffn_gate"] = _quantized_gate(w, il, xin, gate, qtype, threshold)
        layers.append({k: q[k] for k in f})  # the file's tensor order, as layer() gives it
        act = activation_values(activation, xin @ _values(q["ffn_gate"], s.n_embd).T, threshold) * up_values(
            activation, xin @ _values(q["ffn_up"], s.n_embd).T)
        ffn = act @ _values(q["ffn_down"], s.n_ff).T
        at = 0
        for x in h:
            x += ffn[at:at + x.shape[0]]
            at += x.shape[0]
    out_w = walk_output(embeddings, w.walk, 1 + w.n_ctx_dims)
    write_gguf(out, "llama", name, s, tok_fields, activation, threshold, SYNTHETIC_NOTE, embeddings,
               lambda il: layers[il], qtype, progress=progress,
               output=as_tensor(out_w, QT.F16 if qtype == QT.F32 else qtype))
    del layers, embeddings, out_w  # the quantized model (4 GB at 7B) before llama.cpp loads it
    prof = run_profile(out, corpus, calib_tokens, heldout_tokens, threads=threads, progress=progress)
    gates = _written_gates(out)
    report = _measure(w, prof.heldout, activation, threshold, prof.window, prof.train, gates)
    worst, worst_overlap = 0.0, 0.0
    for il, x in enumerate(prof.train):
        a = _active(x.astype(np.float32) @ gates(il).T, activation, threshold)
        d, o = float(a.mean()), activation_stats.lag1_overlap(a, prof.window)
        report[il] = replace(report[il], calib_density=d, calib_overlap=o)
        worst = max(worst, abs(d - report[il].target_density) / report[il].target_density)
        worst_overlap = max(worst_overlap, abs(o - target_overlap(w.freq[il])))
    if progress:
        tqdm.write(f"calibration checked through llama.cpp on the calibration text: densities within {worst:.1%} "
                   f"of the target, lag-1 overlap within {worst_overlap:.3f}")
    return report


def walk_tokens(model: Path, corpus: Any, n: int) -> list[int]:
    """The first n distinct tokens of the corpus's training documents in order of first appearance (fewer if it
    has fewer): a synthetic model's output walks them (_Weights.output)."""
    from ..runtime.runner import LlamaRunner

    seen: dict[int, None] = {}
    with LlamaRunner(model, n_ctx=64) as r:
        for doc in corpus.split()[0]:
            for tok in r.tokenize(doc + "\n\n"):
                seen.setdefault(tok, None)
            if len(seen) >= n:
                break
    if len(seen) < 2:
        raise Pi2Error(f"the corpus {corpus.name} gives fewer than 2 distinct tokens for the output walk")
    return list(seen)[:n]
