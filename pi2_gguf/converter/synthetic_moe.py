"""Synthetic MoE GGUF models (routed experts), in the layouts llama.cpp runs them: llama (Mixtral,
TurboSparse-Mixtral), qwen3moe (Qwen3-30B-A3B), smallthinker (router read before attention), gpt-oss (biased
SwiGLU-OAI experts) and deepseek2 (DeepSeek-V2-Lite: latent attention, dense first layers, shared experts). Their text is
meaningless; their shape, size, routing and sparsity inside experts are the point.

How the model is made (dense synthetic models: synthetic.py):
- Residual dimension 0 carries a constant (embeddings set it; nothing writes it), so after the RMS norm x_0 is
  nearly the same on every token: gate column 0 acts as a per-neuron bias, router column 0 as a per-expert bias.
- Routing skew: expert e's router bias is skew * log(p_e) for Zipf popularities p_e ~ 1/(rank + 1).
- Routing locality: dimensions 1..n_embd/8 are context dimensions. Only attention writes them, and its queries
  and keys read dimension 0 alone, so every score depends on the distance between positions only (RoPE) and
  peaks at distance 0: they hold a recency-weighted mean of the recent tokens. The router reads them with
  weight `locality` and the token dimensions with weight 1 - locality, so consecutive tokens share experts
  more often as locality grows.
- Sparsity inside experts: gate rows low-rank plus noise (Sparsity.gates "lowrank", as synthetic.py's) or full rank
  ("context"); each neuron gets a firing frequency (synthetic.Sparsity); its bias is the quantile
  of its pre-activation under the normed residual's distribution (dimension 0 constant, the rest Gaussian)
  that gives that frequency. The frequencies a text really gives are measured by running it
  (tools/make_model.py reports them).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import ExpertGatingFuncType, GGUFWriter
from gguf import GGUFReader
from tqdm import tqdm

from ..errors import Pi2Error
from . import bundles
from .gaussian_weights import DIRECT_TYPES, GaussianMatrix, Weight, as_array
from .profile import FFN_INPUT, FFN_INPUT_OF_ARCH, routed_experts
from . import activation_stats
from .activation_stats import ActivationStats
from .synthetic import (ACTIVATIONS, FATRELU_THRESHOLD, STATS_MODES, WALK_TOKENS, Sparsity, _n_vocab, _tokenizer_fields,
                        as_tensor, patch_tensors, walk_output, walk_tokens, write_gguf)

ARCHS = ("llama", "qwen3moe", "smallthinker", "gpt-oss", "deepseek2")
# gpt-oss's graph computes SwiGLU-OAI whatever a file states, on biased experts: the model states no activation and
# its gates fire as a SiLU model's (about half the neurons, no sparsity to calibrate)
ARCH_BUILT_ACTIVATION = {"gpt-oss": "silu"}
CONTEXT_DIMS_DIV = 8  # n_embd / this residual dimensions carry context (written by attention only)
# stats "real" inside experts [fit] (TurboSparse-Mixtral, 85% sparse inside each expert, TurboSparse arXiv 2406.05955):
# propensities Beta(mu c, (1 - mu) c), mu 1.5x the density (0.15 at the default 0.10), c 2
EXPERT_DENSITY_FACTOR = 1.5
EXPERT_CONCENTRATION = 2.0
# deepseek2's multi-head latent attention, at DeepSeek-V2's sizes: query and key-value latents of these ranks, and
# per head 128 dimensions without RoPE and 64 with it for keys, 128 for values (the model states them)
MLA_Q_LORA, MLA_KV_LORA, MLA_NOPE, MLA_ROPE, MLA_V = 1536, 512, 128, 64, 128
# stats "real" routing: the session heads' output gain, and the frequent tokens left out of their values (at most a
# quarter of the token dimensions)
SESSION_GAIN = 8.0
SESSION_FREQUENT_TOKENS = 64
# the router's input where it is not the FFN's (smallthinker routes on the layer input; its attention norm is that
# input scaled per token, which keeps each token's ranking of the experts)
ROUTE_GRID = (-2.0, -0.5, 1.0, 2.5)  # log scales route_fit tries first
ROUTER_INPUT_OF_ARCH = {"smallthinker": "attn_norm"}


@dataclass(frozen=True)
class MoeShape:
    n_embd: int = 1024
    n_ff: int = 2816      # per expert
    n_layer: int = 16
    n_head: int = 16
    n_head_kv: int = 4
    n_expert: int = 8
    n_expert_used: int = 2
    n_ctx: int = 2048
    # deepseek2 (DeepSeek-V2 and -V3's layout): the first n_dense_lead layers are dense FFNs of n_ff_dense, every
    # later one has n_shared shared experts (one FFN of n_shared * n_ff) beside its routed ones
    n_dense_lead: int = 0
    n_ff_dense: int = 0
    n_shared: int = 0
    n_rot: int = 0  # RoPE dimensions a head (0: all of n_embd / n_head)

    def params(self, n_vocab: int) -> int:
        hd = self.n_embd // self.n_head
        attn = self.n_embd * self.n_embd * 2 + self.n_embd * hd * self.n_head_kv * 2
        experts = self.n_expert * 3 * self.n_embd * self.n_ff + self.n_expert * self.n_embd
        return self.n_layer * (experts + attn + 2 * self.n_embd) + n_vocab * self.n_embd + self.n_embd

    def active_params(self, n_vocab: int) -> int:
        hd = self.n_embd // self.n_head
        attn = self.n_embd * self.n_embd * 2 + self.n_embd * hd * self.n_head_kv * 2
        return self.n_layer * (self.n_expert_used * 3 * self.n_embd * self.n_ff + attn) + n_vocab * self.n_embd


@dataclass(frozen=True)
class Routing:
    skew: float = 1.0      # router bias = skew * log(Zipf popularity): 0 is uniform
    locality: float = 0.5  # weight of the context dimensions in the router's logits, in [0, 1]


def _inv_norm_cdf(p: np.ndarray) -> np.ndarray:
    """Acklam's rational approximation of the standard normal quantile (|error| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    p = np.clip(np.asarray(p, np.float64), 1e-12, 1 - 1e-12)
    out = np.empty_like(p)
    lo, hi = p < 0.02425, p > 1 - 0.02425
    mid = ~(lo | hi)
    q = np.sqrt(-2 * np.log(p[lo]))
    out[lo] = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
              ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = np.sqrt(-2 * np.log(1 - p[hi]))
    out[hi] = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
               ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = p[mid] - 0.5
    r = q * q
    out[mid] = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
               (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    return out


class _MoeWeights:
    """All weights as float32, layer by layer from a seed."""

    def __init__(self, shape: MoeShape, sparsity: Sparsity, routing: Routing, activation: str, threshold: float,
                 n_vocab: int, seed: int) -> None:
        self.shape, self.sparsity, self.routing = shape, sparsity, routing
        self.activation, self.threshold, self.n_vocab, self.seed = activation, threshold, n_vocab, seed
        self.n_ctx_dims = max(1, shape.n_embd // CONTEXT_DIMS_DIV)
        self.resid_const = float(np.sqrt(3.0 * shape.n_embd))
        self.bias: list[np.ndarray | None] = [None] * shape.n_layer  # [n_expert, n_ff] once calibrated
        self.walk: list[int] | None = None  # stats "real": the output layer's cycle of tokens
        self.real = sparsity.stats == "real"
        # stats "real": per layer the router's scales (token, short context, session, popularity bias over the router
        # input's dimension 0), set by calibration (route_fit); and the frequent tokens' embedding directions the
        # session heads' values leave out (set from the calibration text)
        self.route_mix: list[tuple[float, float, float, float]] = [(1.0, 1.0, 1.0, 1.0 / np.sqrt(0.75 * shape.n_embd))
                                                                    for _ in range(shape.n_layer)]
        self.frequent_basis: np.ndarray | None = None  # [token dims, K] orthonormal
        # stats "real" in a 4-bit type (gaussian_weights.DIRECT_TYPES; set by the maker): up and down drawn as codes
        # when written; else drawn in the layer's stream, as every model before
        self.codes = False

    def embeddings(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1])
        e = rng.standard_normal((self.n_vocab, self.shape.n_embd), dtype=np.float32)
        e[:, 0] = self.resid_const
        e[:, 1:1 + self.n_ctx_dims] = 0.0  # context dimensions: attention writes them
        return e

    def freq(self, il: int, e: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """Target firing frequency of each neuron of expert e in layer il (regenerable from the seed)."""
        if self.activation == "silu":
            return np.full(self.shape.n_ff, 0.5, np.float32)
        if self.sparsity.stats == "real":  # TurboSparse-Mixtral-like [fit]: Beta(mu c, (1 - mu) c) inside each expert
            return self.sparsity.real_frequencies(self.shape.n_ff, min(EXPERT_DENSITY_FACTOR * self.sparsity.density, 0.5),
                                                  np.random.default_rng([self.seed, 8, il, e]), EXPERT_CONCENTRATION)
        return self.sparsity.frequencies(self.shape.n_ff, np.random.default_rng([self.seed, 3, il, e]))

    def layer(self, il: int, arch: str) -> dict[str, Weight]:
        s, m = self.shape, self.n_ctx_dims
        rng = np.random.default_rng([self.seed, 2, il])
        hd = s.n_embd // s.n_head
        n_kv = hd * s.n_head_kv
        sc = 1.0 / np.sqrt(s.n_embd)
        tok = slice(1 + m, s.n_embd)
        # normed residual: dimension 0 about sqrt(3 n / 4), the others variance about 1/4
        x0 = float(np.sqrt(0.75 * s.n_embd))
        # gpt-oss's FFN norm is its post-attention norm
        w: dict[str, Weight] = {"attn_norm": np.ones(s.n_embd, np.float32),
                                    "post_attention_norm" if arch == "gpt-oss" else "ffn_norm": np.ones(s.n_embd, np.float32)}
        # queries and keys read dimension 0 only: scores depend on distance alone, highest at distance 0
        q = np.zeros((s.n_embd, s.n_embd), np.float32)
        k = np.zeros((n_kv, s.n_embd), np.float32)
        q[:, 0] = 3.0 / x0
        k[:, 0] = 3.0 / x0
        w["attn_q"], w["attn_k"] = q, k
        v = np.zeros((n_kv, s.n_embd), np.float32)
        v[:, tok] = rng.standard_normal((n_kv, s.n_embd - 1 - m), dtype=np.float32) * sc
        w["attn_v"] = v
        o = np.zeros((s.n_embd, s.n_embd), np.float32)  # writes the context dimensions only
        o[1:1 + m, :] = rng.standard_normal((m, s.n_embd), dtype=np.float32) * (4.0 * sc)
        w["attn_output"] = o
        if arch == "qwen3moe":
            w["attn_q_norm"] = np.ones(hd, np.float32)
            w["attn_k_norm"] = np.ones(hd, np.float32)
        if arch == "deepseek2":  # latent attention in place of these (its lite layout has an attn_q of its own)
            del w["attn_q"], w["attn_k"], w["attn_v"]
            w.update(self._mla(rng, x0, tok))
            if il < s.n_dense_lead:  # a dense FFN layer: no router, no experts
                w.update(self._dense_ffn(rng, s.n_ff_dense, tok))
                return w
        # router: token dimensions, context dimensions, and a Zipf bias in column 0
        r = np.zeros((s.n_expert, s.n_embd), np.float32)
        lam = self.routing.locality
        r[:, tok] = rng.standard_normal((s.n_expert, s.n_embd - 1 - m), dtype=np.float32) * (2.0 * (1 - lam) / np.sqrt(s.n_embd - 1 - m) * 2)
        r[:, 1:1 + m] = rng.standard_normal((s.n_expert, m), dtype=np.float32) * (2.0 * lam / np.sqrt(m) * 2)
        pop = 1.0 / (rng.permutation(s.n_expert) + 1.0)
        r[:, 0] = (self.routing.skew * np.log(pop) / x0).astype(np.float32)
        w["ffn_gate_inp"] = r
        gates: list[np.ndarray] = []
        ups: list[np.ndarray] = []
        downs: list[np.ndarray] = []
        sd_down = 1.0 / np.sqrt(s.n_ff * self.sparsity.density)
        t = self.threshold if self.activation == "fatrelu" else 0.0
        for e in range(s.n_expert):
            if self.sparsity.gates == "lowrank":
                # rank n_embd / 32 plus 15% noise, as synthetic.py's dense gates: trained FFNs' gates are close to
                # low rank, which is what lets a predictor of low rank select their neurons
                rk = max(8, s.n_embd // 32)
                u = rng.standard_normal((s.n_ff, rk), dtype=np.float32)
                v = rng.standard_normal((rk, s.n_embd), dtype=np.float32) / np.float32(np.sqrt(rk * s.n_embd))
                g = u @ v
                g += rng.standard_normal(g.shape, dtype=np.float32) * (0.15 * float(g.std()))
            else:  # full rank: firing a low-rank predictor sees only in part
                g = rng.standard_normal((s.n_ff, s.n_embd), dtype=np.float32) * sc
            g[:, 1:1 + m] = 0.0  # experts read the token dimensions
            sigma = np.sqrt(np.sum(g[:, tok] ** 2, axis=1)) * 0.5
            freq = self.freq(il, e, rng)
            # first guess, the normed residual taken as Gaussian: P(g.x + b x0 > t) = freq  =>
            # b = (t + sigma * Phi^-1(1 - freq)) / x0; calibration replaces it with measured quantiles
            bias = self.bias[il]
            g[:, 0] = bias[e] if bias is not None else ((t + sigma * _inv_norm_cdf(1.0 - freq)) / x0).astype(np.float32)
            gates.append(g)
            if not self.codes:  # the draws of every model before, byte for byte
                ups.append(rng.standard_normal((s.n_ff, s.n_embd), dtype=np.float32) * sc)
                dn = rng.standard_normal((s.n_embd, s.n_ff), dtype=np.float32) * sd_down
                dn[:1 + m, :] = 0.0  # never write dimension 0 or the context dimensions
                downs.append(dn)
        w["ffn_gate_exps"] = np.stack(gates)
        if self.codes:
            # up and down: iid draws nothing calibrates, drawn when written, straight as 4-bit codes (gaussian_weights: a
            # 17 GB model's quantization took most of its making); down never writes dimension 0 or the context dimensions
            w["ffn_up_exps"] = GaussianMatrix((s.n_expert, s.n_ff, s.n_embd), sc, (self.seed, 3, il, 0))
            w["ffn_down_exps"] = GaussianMatrix((s.n_expert, s.n_embd, s.n_ff), sd_down, (self.seed, 3, il, 1),
                                                zero_rows=1 + m)
        else:
            w["ffn_up_exps"] = np.stack(ups)
            w["ffn_down_exps"] = np.stack(downs)
        if self.real:  # after the experts: their weights come from the same stream as the uniform model's
            if arch != "deepseek2":
                self._real_attention(il, w, arch)
            w["ffn_gate_inp"] = self.router(il)
        if arch == "deepseek2" and s.n_shared:
            w.update({f"{k}_shexp": a for k, a in self._dense_ffn(rng, s.n_shared * s.n_ff, tok).items()})
        if arch == "gpt-oss":
            # attention sinks (0: one more logit of 0 in each head's softmax), the output projection's bias, the
            # router's, and the experts' biases: the gate's 0 (its column 0 sets firing, as for the other layouts),
            # up's and down's small (down's never on dimension 0 or the context dimensions)
            w["attn_sinks"] = np.zeros(s.n_head, np.float32)
            w["attn_output.bias"] = np.zeros(s.n_embd, np.float32)
            w["ffn_gate_inp.bias"] = np.zeros(s.n_expert, np.float32)
            w["ffn_gate_exps.bias"] = np.zeros((s.n_expert, s.n_ff), np.float32)
            w["ffn_up_exps.bias"] = rng.standard_normal((s.n_expert, s.n_ff), dtype=np.float32) * np.float32(0.1)
            down_b = rng.standard_normal((s.n_expert, s.n_embd), dtype=np.float32) * np.float32(0.02)
            down_b[:, :1 + m] = 0.0
            w["ffn_down_exps.bias"] = down_b
        return w


    def ctx_slices(self) -> tuple[slice, slice, slice]:
        """stats "real": the residual's short-context, session and token dimensions."""
        m = self.n_ctx_dims
        h = max(1, m // 2)
        return slice(1, 1 + h), slice(1 + h, 1 + m), slice(1 + m, self.shape.n_embd)

    def route_parts(self, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """stats "real": layer il's router parts, rows of unit norm on the token, short-context and session
        dimensions, and the experts' log Zipf popularity (regenerable from the seed)."""
        c, ss, tok = self.ctx_slices()
        e = self.shape.n_expert
        rng = np.random.default_rng([self.seed, 9, il])

        def rows(n: int) -> np.ndarray:
            return rng.standard_normal((e, n), dtype=np.float32) / np.float32(np.sqrt(max(n, 1)))

        r_tok, r_ctx, r_ses = rows(tok.stop - tok.start), rows(c.stop - c.start), rows(ss.stop - ss.start)
        logpop = -activation_stats.WS_POP_ZIPF * np.log(rng.permutation(e) + 1.0)
        return r_tok, r_ctx, r_ses, (logpop - logpop.mean()).astype(np.float32)

    def router(self, il: int) -> np.ndarray:
        """stats "real": ffn_gate_inp from the parts at the layer's calibrated scales (column 0 the popularity bias:
        the router input's dimension 0 is about constant)."""
        c, ss, tok = self.ctx_slices()
        r_tok, r_ctx, r_ses, logpop = self.route_parts(il)
        a_tok, a_ctx, a_ses, a_pop = self.route_mix[il]
        r = np.zeros((self.shape.n_expert, self.shape.n_embd), np.float32)
        r[:, tok] = r_tok * np.float32(a_tok)
        r[:, c] = r_ctx * np.float32(a_ctx)
        r[:, ss] = r_ses * np.float32(a_ses)
        r[:, 0] = logpop * np.float32(a_pop)
        return r

    def _real_attention(self, il: int, w: dict[str, Weight], arch: str) -> None:
        """stats "real": the first half of the heads keep the short memory (queries and keys on dimension 0) and
        write the short-context dimensions; the other half have queries of 0, so they average every earlier token of
        the text alike: in layer 0 they write that running mean (of the token dimensions, the frequent tokens'
        directions left out, so it is the text's own and not English's) into the session dimensions, which no later
        layer writes; a router reading them picks from a working set that is the session's. (Tried: only layer 0
        writing any context, so routers' context would not move with earlier layers' routing: held-out lag-1 overlap
        10 points over the fit's in the middle layers, against within 5 here.)"""
        s = self.shape
        c, ss, tok = self.ctx_slices()
        hd = s.n_embd // s.n_head
        n_short = max(1, s.n_head // 2)
        q, o = as_array(w["attn_q"]), as_array(w["attn_output"])  # drawn arrays: changed in place
        q[n_short * hd:, :] = 0.0
        if self.frequent_basis is not None:
            v = as_array(w["attn_v"])
            b = self.frequent_basis
            v[:, tok] -= (v[:, tok] @ b) @ b.T
        o_short = o[c, :n_short * hd].copy()
        o[1:1 + self.n_ctx_dims, :] = 0.0
        o[c, :n_short * hd] = o_short
        if il == 0 and n_short < s.n_head:
            rng = np.random.default_rng([self.seed, 10, il])
            cols = (s.n_head - n_short) * hd
            o[ss, n_short * hd:] = rng.standard_normal((ss.stop - ss.start, cols), dtype=np.float32) * np.float32(
                SESSION_GAIN / np.sqrt(cols))
        del arch

    def _dense_ffn(self, rng: np.random.Generator, n_ff: int, tok: slice) -> dict[str, np.ndarray]:
        """A SiLU FFN of n_ff neurons reading and writing the token dimensions (deepseek2's dense first layers and
        shared experts): gate, up and down as ffn_gate, ffn_up, ffn_down."""
        n, m = self.shape.n_embd, self.n_ctx_dims
        g = rng.standard_normal((n_ff, n), dtype=np.float32) / np.float32(np.sqrt(n))
        g[:, :1 + m] = 0.0
        u = rng.standard_normal((n_ff, n), dtype=np.float32) / np.float32(np.sqrt(n))
        d = rng.standard_normal((n, n_ff), dtype=np.float32) / np.float32(np.sqrt(n_ff))
        d[:1 + m, :] = 0.0
        return {"ffn_gate": g, "ffn_up": u, "ffn_down": d}

    def _mla(self, rng: np.random.Generator, x0: float, tok: slice) -> dict[str, np.ndarray]:
        """deepseek2's attention with the other layouts' property: queries and keys read dimension 0 alone (their
        RoPE halves; the halves without RoPE score 0), so scores depend on distance only, and values read the token
        dimensions, written to the context dimensions."""
        s, m = self.shape, self.n_ctx_dims
        sc = 1.0 / np.sqrt(s.n_embd)
        kv_a = np.zeros((MLA_KV_LORA + MLA_ROPE, s.n_embd), np.float32)
        kv_a[:MLA_KV_LORA, tok] = rng.standard_normal((MLA_KV_LORA, s.n_embd - tok.start), dtype=np.float32) * sc
        kv_a[MLA_KV_LORA:, 0] = 3.0 / x0
        v_b = rng.standard_normal((s.n_head, MLA_V, MLA_KV_LORA), dtype=np.float32) / np.float32(np.sqrt(MLA_KV_LORA))
        o = np.zeros((s.n_embd, s.n_head * MLA_V), np.float32)
        o[1:1 + m, :] = rng.standard_normal((m, s.n_head * MLA_V), dtype=np.float32) * (4.0 / np.sqrt(s.n_head * MLA_V))
        if mla_lite(s.n_layer, self.n_vocab):  # one query matrix: its rope rows read x's constant dimension, as above
            q = np.zeros((s.n_head, MLA_NOPE + MLA_ROPE, s.n_embd), np.float32)
            q[:, MLA_NOPE:, 0] = 3.0 / x0
            queries: dict[str, np.ndarray] = {"attn_q": q.reshape(s.n_head * (MLA_NOPE + MLA_ROPE), s.n_embd)}
        else:  # a query LoRA: the latent reads dimension 0, the rope rows sum the normed latent
            q_a = np.zeros((MLA_Q_LORA, s.n_embd), np.float32)
            q_a[:, 0] = 1.0 / x0
            q_b = np.zeros((s.n_head, MLA_NOPE + MLA_ROPE, MLA_Q_LORA), np.float32)
            q_b[:, MLA_NOPE:, :] = 3.0 / MLA_Q_LORA  # the normed latent is about 1 in every dimension
            queries = {"attn_q_a": q_a, "attn_q_a_norm": np.ones(MLA_Q_LORA, np.float32),
                       "attn_q_b": q_b.reshape(s.n_head * (MLA_NOPE + MLA_ROPE), MLA_Q_LORA)}
        return {**queries, "attn_kv_a_mqa": kv_a, "attn_kv_a_norm": np.ones(MLA_KV_LORA, np.float32),
                "attn_k_b": np.zeros((s.n_head, MLA_KV_LORA, MLA_NOPE), np.float32), "attn_v_b": v_b,
                "attn_output": o}


def mla_lite(n_layer: int, n_vocab: int) -> bool:
    """Whether llama.cpp loads a deepseek2 model of this size as DeepSeek-V2-Lite's layout (src/models/deepseek2.cpp:
    26 or 27 layers, or 48 with a 128,256-token vocabulary): one query matrix attn_q, no query LoRA (q_a, q_b)."""
    return n_layer in (26, 27) or (n_layer == 48 and n_vocab == 128256)


def moe_tensor_type(k: str, arch: str, qtype: QT) -> QT:
    """The type a layer tensor (name suffix k) is written in, in a model of matrices in qtype."""
    # MXFP4 is the experts' type (gpt-oss's published files): the other matrices Q8_0
    if k == "ffn_gate_inp" or k.endswith(".bias"):  # the router and biases stay f32 (ADD_ID adds f32 only)
        return QT.F32
    if arch == "deepseek2" and k.startswith("attn_") and qtype not in (QT.F32, QT.F16):
        return QT.Q8_0  # its latent attention has rows of 128 (k_b): Q8_0, as its published files keep it
    return QT.Q8_0 if qtype == QT.MXFP4 and "_exps" not in k else qtype


def write_moe_model(path: Path, w: _MoeWeights, tok_fields: list, arch: str, qtype: QT, name: str,
                    progress: bool = True) -> Path:
    """Writes the GGUF atomically (synthetic.write_gguf), with the expert hyperparameters."""
    s = w.shape

    def hparams(gw: GGUFWriter) -> None:
        gw.add_expert_feed_forward_length(s.n_ff)
        gw.add_expert_count(s.n_expert)
        gw.add_expert_used_count(s.n_expert_used)
        if arch == "smallthinker":
            gw.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
        if arch == "gpt-oss":
            gw.add_sliding_window(s.n_ctx)  # its sliding-window layers then see what its full ones see
        if arch == "deepseek2":  # DeepSeek-V2-Lite's routing: softmax, weights as they are
            gw.add_leading_dense_block_count(s.n_dense_lead)
            gw.add_expert_shared_count(s.n_shared)
            gw.add_expert_weights_scale(1.0)
            gw.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
            if not mla_lite(s.n_layer, w.n_vocab):
                gw.add_q_lora_rank(MLA_Q_LORA)
            gw.add_kv_lora_rank(MLA_KV_LORA)
            # llama.cpp's converter states the cached latent's sizes as the head's, the head's as *_mla
            gw.add_key_length(MLA_KV_LORA + MLA_ROPE)
            gw.add_value_length(MLA_KV_LORA)
            gw.add_key_length_mla(MLA_NOPE + MLA_ROPE)
            gw.add_value_length_mla(MLA_V)

    embeddings = w.embeddings()
    out_type = QT.Q8_0 if qtype == QT.MXFP4 else QT.F16 if qtype == QT.F32 else qtype
    output = as_tensor(embeddings, QT.Q8_0 if qtype == QT.MXFP4 else qtype) if arch == "gpt-oss" else None
    if w.walk is not None:
        output = as_tensor(walk_output(embeddings, w.walk, 1 + w.n_ctx_dims), out_type)
    return write_gguf(path, arch, name, s, tok_fields, None if arch in ARCH_BUILT_ACTIVATION else w.activation, w.threshold,
                      "synthetic MoE model made by pi2-gguf tools/make_model.py: its text is meaningless", embeddings,
                      lambda il: {k: as_tensor(a, moe_tensor_type(k, arch, qtype)) for k, a in w.layer(il, arch).items()},
                      qtype, hparams, progress, output=output)


@dataclass(frozen=True)
class MoeLayerReport:
    target_density: float    # mean target firing frequency inside the experts
    density: float           # measured: fired gates / neurons of the routed experts (held-out text; nan: SiLU)
    top_expert_share: float  # share of routed choices that went to the layer's most used expert
    lru_hits: dict[int, float]  # cache size in experts (this layer's) -> LRU hit rate over the tokens
    layer: int = -1             # the model layer (deepseek2's dense first layers have no report)
    # routing's skew, persistence and expert-cache hit rates (activation_stats), the static hot set ranked on the
    # calibration text's routing (else the held-out text's own)
    stats: ActivationStats | None = None
    reuse: dict[int, float] | None = None  # activation_stats.reuse_within: lag -> share of a token's experts reused
    reuse_median: float = 0.0             # median reuse distance, tokens
    lru_qwen: dict[float, float] | None = None  # steady LRU hits at QWEN3_LRU_FRACTIONS of the experts cached
    position: str = "middle"              # activation_stats.layer_position
    fit: ActivationStats | None = None    # the [fit] working-set generator's, for this size, position and text


def lru_hit_rate(routes: list[np.ndarray], size: int) -> float:
    """Hit rate of an LRU cache of `size` experts over a token sequence's routed experts (each an index array)."""
    cache: dict[int, int] = {}
    hits = total = 0
    for step, sel in enumerate(routes):
        for e in sel.tolist():
            total += 1
            if e in cache:
                hits += 1
            elif len(cache) >= size:
                del cache[min(cache, key=cache.__getitem__)]
            cache[e] = step
    return hits / max(total, 1)


def routing_profile(path: Path, tokens: list[int], n_layer: int, threads: int | None, arch: str,
                    window: int | None = None, router_input: bool = False) -> tuple[dict, ...]:
    """Per layer, the FFN inputs [n_tok, n_embd] and router logits [n_tok, n_expert] of `tokens` (windows of `window`
    tokens, each from position 0; default one window), through the plugin: it computes the stated activation, which
    llama.cpp's MoE graph alone does not. With router_input, also the router's inputs (ROUTER_INPUT_OF_ARCH)."""
    from .. import register
    from ..runtime.runner import LlamaRunner

    seen: dict[tuple[str, int], list[np.ndarray]] = {}
    register()
    ffn_input = FFN_INPUT_OF_ARCH.get(arch, FFN_INPUT)
    r_input = ROUTER_INPUT_OF_ARCH.get(arch, ffn_input)
    watch = (ffn_input, "ffn_moe_logits") + ((r_input,) if router_input and r_input != ffn_input else ())
    win = window or len(tokens)
    with LlamaRunner(path, n_ctx=win + 8, n_threads=threads, watch=watch,
                     sink=lambda il, name, a: seen.setdefault((name, il), []).append(a.copy()), repack=False) as r:
        for i in range(0, len(tokens), win):
            r.decode(tokens[i:i + win])
    routed = [il for il in range(n_layer) if ("ffn_moe_logits", il) in seen]  # not deepseek2's dense first layers
    xs = {il: np.concatenate(seen[(ffn_input, il)]) for il in routed}
    lg = {il: np.concatenate(seen[("ffn_moe_logits", il)]) for il in routed}
    if not router_input:
        return xs, lg
    return xs, lg, {il: np.concatenate(seen[(r_input, il)]) for il in routed}


def _robust_scale(z: np.ndarray) -> float:
    """A spread of z that the first tokens' large running means do not set: the median absolute deviation, as a
    normal's standard deviation."""
    s = float(np.median(np.abs(z - np.median(z)))) / 0.6745
    return s if s > 1e-12 else 1.0


def route_targets(n_expert: int, k: int, window: int) -> dict[str, dict[str, float]]:
    """The [fit] generator's figures calibration aims at for each layer position: lag-1 overlap and steady LRU and
    static-hot hits at CACHE_FRACTIONS, over windows of `window` tokens (the static hot set from another session)."""
    out = {}
    for pos in activation_stats.WS_LAYERS:
        f = activation_stats.working_set_fit_stats(n_expert, k, window, pos)
        out[pos] = {"lag1": f.lag1_overlap, **{f"lru{x}": f.steady["LRU"][x] for x in activation_stats.CACHE_FRACTIONS},
                    **{f"hot{x}": f.steady["static-hot"][x] for x in activation_stats.CACHE_FRACTIONS}}
    return out


def route_figures(routes: np.ndarray, n_expert: int, window: int) -> dict[str, float]:
    """The figures route_targets names, of routes [n_tok, k] over windows of `window` tokens: the static hot set of
    each window ranked on the other windows (on the other half of the text if it is one window)."""
    a = activation_stats.routed_active(routes, n_expert)
    fr = activation_stats.CACHE_FRACTIONS
    out = {"lag1": activation_stats.lag1_overlap(a, window),
           **{f"lru{x}": v for x, v in activation_stats.lru_hits(a, fr, window).items()}}
    n = a.shape[0]
    parts = [slice(i, min(i + window, n)) for i in range(0, n, window)] if n > window else \
        [slice(0, n // 2), slice(n // 2, n)]
    total = a.sum(axis=0)
    hot = np.zeros(len(fr))
    need = 0
    for sl in parts:
        rank = np.argsort(-(total - a[sl].sum(axis=0)), kind="stable")
        cnt = a[sl].sum(axis=0)
        need += int(cnt.sum())
        hot += [cnt[rank[:max(1, int(round(x * n_expert)))]].sum() for x in fr]
    out.update({f"hot{x}": float(h / max(need, 1)) for x, h in zip(fr, hot)})
    return out


def _route_loss(got: dict[str, float], want: dict[str, float]) -> float:
    return sum((1.0 if not k.startswith("hot") else 0.5) * (got[k] - want[k]) ** 2 for k in want)


def _nelder_mead(f, x0: np.ndarray, step: float = 1.0, iters: int = 60) -> np.ndarray:
    """Minimises f from x0 (a plain Nelder-Mead; the loss is a step function of the scales, so no gradients)."""
    pts = [x0] + [x0 + step * np.eye(x0.size)[i] for i in range(x0.size)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2.0 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def _route_parts_of(w: _MoeWeights, il: int, x: np.ndarray) -> tuple[list[np.ndarray], list[float]]:
    """The router parts' logits [n_tok, n_expert] on router inputs x (token, short context, session, popularity)
    and each one's spread."""
    c, ss, tok = w.ctx_slices()
    r_tok, r_ctx, r_ses, logpop = w.route_parts(il)
    zs = [x[:, tok] @ r_tok.T, x[:, c] @ r_ctx.T, x[:, ss] @ r_ses.T,
          np.broadcast_to(logpop, (x.shape[0], logpop.size))]
    return zs, [_robust_scale(zs[0]), _robust_scale(zs[1]), _robust_scale(zs[2]), float(logpop.std()) or 1.0]


def route_fit(w: _MoeWeights, rx: dict, window: int, targets: dict[str, dict[str, float]],
              fitted: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """stats "real": each routed layer's router scales (short context, session and popularity against the token
    part, log scales) whose routing of the calibration text's router inputs rx gives its position's target figures.
    The first, a middle and the last routed layer are fitted (from `fitted`'s scales, a previous round's); the other
    layers take the middle one's scales against their own parts' spreads. Returns the fitted log scales."""
    layers = sorted(rx)
    first, last = layers[0], layers[-1]
    fit_at = {"first": first, "middle": layers[len(layers) // 2], "last": last}
    k = w.shape.n_expert_used
    got: dict[str, np.ndarray] = {}
    for pos, il in fit_at.items():
        x = rx[il].astype(np.float32)
        zs, sd = _route_parts_of(w, il, x)
        base = zs[0] / sd[0]
        rest = [z / s for z, s in zip(zs[1:], sd[1:])]

        def loss(u: np.ndarray) -> float:
            lg = base + sum(np.exp(ui) * z for ui, z in zip(u, rest))
            return _route_loss(route_figures(routed_experts(lg, k), w.shape.n_expert, window), targets[pos])

        if fitted:
            start = fitted[pos]
        else:  # a coarse grid first: the loss has flat stretches a simplex alone can stall on
            grid = [np.array(g, float) for g in np.array(np.meshgrid(*[ROUTE_GRID] * 3)).reshape(3, -1).T]
            start = min(grid, key=loss)
        got[pos] = _nelder_mead(loss, start, 0.5, 30 if fitted else 50)
        if os.environ.get("PI2_ROUTE_FIT_DEBUG"):
            print(pos, il, got[pos], loss(got[pos]), file=sys.stderr)
    for il in layers:
        pos = activation_stats.layer_position(il, first, last)
        u = got[pos]
        _, sd = _route_parts_of(w, il, rx[il].astype(np.float32))
        x0 = float(np.mean(rx[il][:, 0])) or 1.0
        w.route_mix[il] = (1.0 / sd[0], float(np.exp(u[0])) / sd[1], float(np.exp(u[1])) / sd[2],
                           float(np.exp(u[2])) / sd[3] / x0)
    return got


def _calibrate(w: _MoeWeights, arch: str, xs: dict, lg: dict) -> None:
    """Sets each expert neuron's bias so that its gate passes the cut on its target share of the tokens routed to
    that expert (all tokens where fewer than 16 were)."""
    s = w.shape
    t = w.threshold
    for il in lg:
        x = xs[il].astype(np.float32)
        routed = routed_experts(lg[il], s.n_expert_used)
        gates = as_array(w.layer(il, arch)["ffn_gate_exps"])
        bias = np.empty((s.n_expert, s.n_ff), np.float32)
        for e in range(s.n_expert):
            xe = x[(routed == e).any(axis=1)]
            if xe.shape[0] < 16:
                xe = x
            g = gates[e].copy()
            g[:, 0] = 0.0
            z = np.sort(xe @ g.T, axis=0)
            idx = np.clip(np.floor((1.0 - w.freq(il, e)) * (z.shape[0] - 1)).astype(int), 0, z.shape[0] - 1)
            cut = z[idx, np.arange(s.n_ff)]
            bias[e] = (t - cut) / float(np.mean(xe[:, 0]))
        w.bias[il] = bias


def _report(w: _MoeWeights, arch: str, xs: dict, lg: dict, calib_lg: dict | None = None) -> list[MoeLayerReport]:
    s = w.shape
    out = []
    sizes = sorted({max(1, s.n_expert // 8), max(1, s.n_expert // 4), max(1, s.n_expert // 2), s.n_expert_used})
    layers = sorted(lg)
    n_calib = next(iter(calib_lg.values())).shape[0] if calib_lg else None
    fits: dict[str, ActivationStats] = {}
    for il in lg:  # the layers with routed experts
        x = xs[il].astype(np.float32)
        routed = routed_experts(lg[il], s.n_expert_used)
        if w.activation == "silu":  # every neuron computes: no density to measure (and no layer to regenerate)
            density = float("nan")
        else:
            gates = as_array(w.layer(il, arch)["ffn_gate_exps"])
            fired = sum(int(np.sum(gates[e] @ x[i] > w.threshold)) for i in range(x.shape[0]) for e in routed[i])
            density = fired / (routed.size * s.n_ff)
        counts = np.bincount(routed.ravel(), minlength=s.n_expert)
        target = float(np.mean([w.freq(il, e).mean() for e in range(s.n_expert)]))
        rank = None
        if calib_lg is not None and il in calib_lg:
            seen = np.bincount(routed_experts(calib_lg[il], s.n_expert_used).ravel(), minlength=s.n_expert)
            rank = np.argsort(-seen, kind="stable")
        active = activation_stats.routed_active(routed, s.n_expert)
        st = activation_stats.activation_stats(active, rank)
        reuse, med = activation_stats.reuse_within(active, active.shape[0])
        pos = activation_stats.layer_position(il, layers[0], layers[-1])
        if pos not in fits:
            fits[pos] = activation_stats.working_set_fit_stats(s.n_expert, s.n_expert_used, active.shape[0], pos,
                                                               calib_tokens=n_calib)
        out.append(MoeLayerReport(target, density, float(counts.max() / counts.sum()),
                                  {c: lru_hit_rate(list(routed), c) for c in sizes}, il, st, reuse, med,
                                  activation_stats.lru_hits(active, activation_stats.QWEN3_LRU_FRACTIONS), pos,
                                  fits[pos]))
    return out


def make_moe(path: str | Path, shape: MoeShape, sparsity: Sparsity, routing: Routing, arch: str = "llama",
             activation: str = "drelu", qtype: QT = QT.Q4_K, seed: int = 0, tokenizer_from: str | Path | None = None,
             threshold: float = FATRELU_THRESHOLD, progress: bool = True, text: str | Path | None = None,
             calib_tokens: int = 0, heldout_tokens: int = 0, rounds: int = 2,
             threads: int | None = None) -> list[MoeLayerReport]:
    """Writes a synthetic MoE model to path. With calib_tokens, the experts' biases are calibrated on that many
    tokens of text (`rounds` times; the model is written once and each round patches the tensors it changes in
    place); with heldout_tokens, returns per-layer densities
    and routing measured on held-out text (else an empty list)."""
    from ..assets import corpus as corpus_mod
    from ..assets import models

    if arch not in ARCHS:
        raise Pi2Error(f"arch '{arch}' is not one of {', '.join(ARCHS)}")
    if activation not in ACTIVATIONS:
        raise Pi2Error(f"activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
    if arch in ARCH_BUILT_ACTIVATION and activation != ARCH_BUILT_ACTIVATION[arch]:
        raise Pi2Error(f"{arch}'s graph computes its own activation (gpt-oss: SwiGLU-OAI on biased experts), whose "
                       f"gates fire as SiLU's: --activation {ARCH_BUILT_ACTIVATION[arch]}, not {activation}")
    if arch == "deepseek2" and activation != "silu":
        raise Pi2Error("deepseek2's synthetic dense first layers and shared experts are SiLU FFNs: --activation silu")
    if arch == "deepseek2" and not (0 < shape.n_dense_lead < shape.n_layer and shape.n_ff_dense > 0):
        raise Pi2Error(f"deepseek2 needs dense first layers and MoE layers after them: n_dense_lead "
                       f"{shape.n_dense_lead} of {shape.n_layer} layers, n_ff_dense {shape.n_ff_dense}")
    if arch == "smallthinker" and activation == "silu":
        raise Pi2Error("smallthinker's experts are ReLU-family: llama.cpp's graph computes ReGLU for them; "
                       "--activation silu would state what that graph does not compute")
    if not 1 <= shape.n_expert_used <= shape.n_expert:
        raise Pi2Error(f"--n-expert-used must be in [1, n_expert={shape.n_expert}], got {shape.n_expert_used}")
    if not (0.0 <= routing.locality <= 1.0 and math.isfinite(routing.skew) and routing.skew >= 0):
        raise Pi2Error(f"routing locality must be in [0, 1] and skew >= 0, got {routing.locality} and {routing.skew}")
    if shape.n_embd % shape.n_head or (shape.n_embd // shape.n_head) % 2:
        raise Pi2Error(f"n_embd {shape.n_embd} must split into {shape.n_head} heads of even size")
    for n, what in ((shape.n_embd, "n_embd"), (shape.n_ff, "n_ff")):
        if qtype not in (QT.F32, QT.F16) and n % bundles.GGML_QUANT_SIZES[qtype][0]:
            raise Pi2Error(f"{qtype.name} rows need a multiple of {bundles.GGML_QUANT_SIZES[qtype][0]} values; {what} is {n}")
    if not 0.0 < sparsity.density < 1.0:
        raise Pi2Error(f"density must be in (0, 1), got {sparsity.density}")
    if sparsity.stats not in STATS_MODES:
        raise Pi2Error(f"stats '{sparsity.stats}' is not one of {', '.join(STATS_MODES)}")
    out = Path(path)
    if not out.parent.is_dir():
        raise Pi2Error(f"output directory {out.parent} does not exist")
    tok_src = Path(tokenizer_from) if tokenizer_from is not None else models.fetch(models.DEFAULT_MODEL, progress)
    tok_fields = _tokenizer_fields(GGUFReader(tok_src, "r"))
    w = _MoeWeights(shape, sparsity, routing, activation, threshold if activation == "fatrelu" else 0.0,
                    _n_vocab(tok_fields), seed)
    w.codes = w.real and moe_tensor_type("ffn_up_exps", arch, qtype) in DIRECT_TYPES
    name = (f"pi2-synthetic-moe-{arch}-{activation}-{shape.n_layer}x{shape.n_embd}x{shape.n_ff}"
            f"-e{shape.n_expert}k{shape.n_expert_used}-d{sparsity.density:g}")
    if sparsity.stats == "real":
        name += "-real"
    corpus = corpus_mod.load(text) if (calib_tokens or heldout_tokens or sparsity.stats == "real") else None
    calib: list[int] = []
    held: list[int] = []
    if corpus is not None:
        # text is tokenized with the tokenizer source's model (the synthetic model carries its tokenizer), so every
        # token list is known before the model is written once
        from ..runtime.runner import LlamaRunner

        train_docs, held_docs = corpus.split()

        def first_tokens(r: LlamaRunner, docs: list[str], n: int) -> list[int]:
            toks: list[int] = []
            for d in docs:
                if len(toks) >= n:
                    break
                toks += r.tokenize(d + "\n\n")
            return toks[:n]

        with LlamaRunner(tok_src, n_ctx=64) as r:
            calib = first_tokens(r, train_docs, calib_tokens)
            held = first_tokens(r, held_docs, heldout_tokens)
        if len(calib) < calib_tokens or len(held) < heldout_tokens:
            raise Pi2Error(f"the corpus {corpus.name} gives {len(calib)} calibration and {len(held)} held-out tokens; "
                           f"{calib_tokens} and {heldout_tokens} were asked")
        if sparsity.stats == "real":
            w.walk = walk_tokens(tok_src, corpus, min(WALK_TOKENS, w.n_vocab))
    real_routing = w.real and bool(calib_tokens) and corpus is not None
    if real_routing:
        # the session heads leave the calibration text's frequent tokens out (attention values, set before writing)
        tok_dims = w.ctx_slices()[2]
        counts = np.bincount(np.asarray(calib), minlength=w.n_vocab)
        n_freq = min(SESSION_FREQUENT_TOKENS, (tok_dims.stop - tok_dims.start) // 4)
        ids = np.argsort(-counts, kind="stable")[:n_freq]
        w.frequent_basis = np.linalg.qr(w.embeddings()[ids][:, tok_dims].T.astype(np.float64))[0].astype(np.float32)
    if not calib_tokens or corpus is None or (activation == "silu" and not real_routing):
        write_moe_model(out, w, tok_fields, arch, qtype, name, progress)
        if not heldout_tokens or corpus is None:
            return []
        calib_lg = routing_profile(out, calib, shape.n_layer, threads, arch)[1] if calib_tokens else None
        held_x, held_lg = routing_profile(out, held, shape.n_layer, threads, arch)[:2]
        return _report(w, arch, held_x, held_lg, calib_lg)
    # Calibration rounds: the model is written once, under a name of its own, and each round patches in place the
    # tensors calibration changes (routers; the experts' gates where they are sparse), then it is renamed into place
    work = out.with_name(f".{out.name}.{os.getpid()}.making")
    try:
        write_moe_model(work, w, tok_fields, arch, qtype, name, progress)
        calib_lg = _calibrate_rounds(work, w, arch, qtype, calib, heldout_tokens, rounds, threads, progress)
        held_x, held_lg = routing_profile(work, held, shape.n_layer, threads, arch)[:2] if heldout_tokens else ({}, {})
        work.replace(out)
    except BaseException:
        work.unlink(missing_ok=True)
        raise
    if not heldout_tokens:
        return []
    return _report(w, arch, held_x, held_lg, calib_lg)


def _calibrate_rounds(path: Path, w: _MoeWeights, arch: str, qtype: QT, calib: list[int], heldout_tokens: int,
                      rounds: int, threads: int | None, progress: bool) -> dict:
    """Calibrates the written model at path in place: stats "real" routing as the [fit] working-set generator's
    (each round fits the router's scales on the router inputs llama.cpp computed), and ReLU-family experts' neurons
    on the tokens that routing sends them. Returns the calibration text's router logits of the last round."""
    s = w.shape
    calib_lg: dict = {}

    def patch(layers: list[int], gates: bool) -> None:
        def tensors() -> Iterator[tuple[str, tuple]]:  # a layer at a time: gates are regenerated whole
            for il in layers:
                full = w.layer(il, arch) if gates else {"ffn_gate_inp": w.router(il)}
                for k in ("ffn_gate_inp", "ffn_gate_exps") if gates else ("ffn_gate_inp",):
                    if k in full:
                        yield f"blk.{il}.{k}.weight", as_tensor(full[k], moe_tensor_type(k, arch, qtype))

        patch_tensors(path, tensors())

    if w.real:
        window = min(heldout_tokens or 512, len(calib))
        targets = route_targets(s.n_expert, s.n_expert_used, window)
        fitted = None
        for _ in tqdm(range(rounds), desc="calibrate routing and experts", unit="round", disable=not progress):
            cx, _, crx = routing_profile(path, calib, s.n_layer, threads, arch, window, router_input=True)
            fitted = route_fit(w, crx, window, targets, fitted)
            calib_lg = {il: crx[il].astype(np.float32) @ w.router(il).T for il in crx}
            if w.activation != "silu":
                _calibrate(w, arch, cx, calib_lg)
            patch(sorted(crx), w.activation != "silu")
    else:
        for _ in tqdm(range(rounds), desc="calibrate experts", unit="round", disable=not progress):
            cx, calib_lg = routing_profile(path, calib, s.n_layer, threads, arch)
            _calibrate(w, arch, cx, calib_lg)
            patch(sorted(calib_lg), True)
    return calib_lg
