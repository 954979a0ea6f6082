"""Per-layer activation predictors: a low-rank MLP x -> h = relu(W1 x + b1) (width r) -> z = W2 h + b2
(n_ff outputs) that predicts the gate pre-activation g = gate . x of every neuron; a neuron is
predicted active when its score (|act(z)| for CATS, z for ReLU-family models) is above a cutoff
chosen on validation tokens to catch a target share of the active neurons (recall).

Why predict g rather than a yes/no logit: in SiLU/GELU models at moderate sparsity many active
neurons sit in the activation's negative lobe (g in an interval below zero, 20-80% of the actives
in SmolLM2 at 50%), which no monotone score of a low-rank output can separate; the activation applied
to a predicted g can.

The default predictor is training-free: reduced-rank regression of g on x over the profiled tokens
(the data-aware form of SVDP's truncated SVD of W_gate, arXiv 2603.14110) gives g ~ x A B (rank
k = r/2), and W1 = [A; -A], W2 = [B, -B] computes it exactly since relu(a) - relu(-a) = a; only the
cutoff is calibrated. `--predictor trained` then fits the MLP with Adam on a squared loss weighted toward
active neurons, so the capacity goes where a miss costs accuracy (docs/CONVERT.md compares the two).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from ..sidecar import format as fmt

DEFAULT_RECALL = 0.99
KINDS = ("svd", "trained")  # --predictor: training-free (reduced-rank regression) or trained with Adam
DEFAULT_KIND = "svd"
ACTIVE_WEIGHT = 4.0   # active neurons weigh more in the loss: a missed neuron costs accuracy
EPOCHS = 2
BATCH = 256
LR = 3e-4
VALIDATION_SHARE = 0.15

Activation = Callable[[np.ndarray], np.ndarray]


@dataclass
class Predictor:
    w1: np.ndarray  # [r, n_embd]
    b1: np.ndarray  # [r]
    w2: np.ndarray  # [n_ff, r]
    b2: np.ndarray  # [n_ff]
    cutoff: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.w1.shape[0])

    def outputs(self, x: np.ndarray) -> np.ndarray:
        """z: the predicted gate pre-activations [n_tokens, n_ff]."""
        h = np.maximum(np.asarray(x, dtype=np.float32) @ self.w1.T + self.b1, 0.0)
        return h @ self.w2.T + self.b2

    def predict(self, x: np.ndarray, score: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        return score(self.outputs(x)) > self.cutoff

    def as_decoded(self, order: np.ndarray | None = None, w2_type: str = fmt.PREDICTOR_W2_TYPES[0]) -> Predictor:
        """The predictor as the plugin decodes with it (sparse/predictor.c): the sidecar's F16 weights, W1's rows
        then in Q8_0 and W2's (one per hidden unit, over the neurons in bundle-slot order: order[s] is slot s's
        neuron; None: model order) in w2_type, where the widths allow (format.predictor_decode_types). A cutoff
        calibrated on these is the one decode meets (Q4_0's rounding moves scores by a few percent)."""
        t1, t2 = fmt.predictor_decode_types(self.w1.shape[1], self.w2.shape[0], self.rank, w2_type)
        slots = np.arange(self.w2.shape[0]) if order is None else np.asarray(order)
        return Predictor(decoded_w1(self.w1, t1), self.b1.astype(np.float32), decoded_w2(self.w2, slots, t2),
                         self.b2.astype(np.float32), self.cutoff)


def decoded_w1(w1: np.ndarray, t1: GGMLQuantizationType) -> np.ndarray:
    """W1 rows [r, n_embd] as decode holds them: F16 (the sidecar's), then t1 per row."""
    w = np.asarray(w1).astype(np.float16).astype(np.float32)
    return w if t1 == GGMLQuantizationType.F16 else quants.dequantize(quants.quantize(w, t1), t1)


def decoded_w2(w2: np.ndarray, slots: np.ndarray, t2: GGMLQuantizationType) -> np.ndarray:
    """W2 [n_ff, r] as decode holds it: F16, then t2 per hidden unit's row over the neurons in slot order (slots[s]:
    slot s's neuron)."""
    w = np.asarray(w2).astype(np.float16).astype(np.float32)
    if t2 != GGMLQuantizationType.F16:
        rows = np.ascontiguousarray(w[slots].T)  # [r, n_ff], neurons in slot order
        w[slots] = quants.dequantize(quants.quantize(rows, t2), t2).T
    return w


def score_fn(method: str, act: Activation) -> Callable[[np.ndarray], np.ndarray]:
    """The score compared with the cutoff: |act(z)| for CATS, z itself for ReLU-family models."""
    if method == "relu":
        return lambda z: z
    return lambda z: np.abs(act(z))


@dataclass(frozen=True)
class Quality:
    recall: float     # predicted-and-active / active
    precision: float  # predicted-and-active / predicted
    density: float    # predicted / all

    @classmethod
    def measure(cls, predicted: np.ndarray, actual: np.ndarray) -> Quality:
        tp = float(np.count_nonzero(predicted & actual))
        n_pred = float(np.count_nonzero(predicted))
        n_act = float(np.count_nonzero(actual))
        return cls(tp / n_act if n_act else 1.0, tp / n_pred if n_pred else 1.0, n_pred / predicted.size)


def rrr_basis(x: np.ndarray, gate_w: np.ndarray, k: int | None = None) -> np.ndarray:
    """The principal directions of g = x gate^T over the data, strongest first [min(n_embd, n_ff, k), n_ff] (k: the
    most a caller uses; None: all).
    With x^T x = R R^T (Cholesky, of x^T x formed in float64 where float32's does not factor; an eigendecomposition
    where x^T x is singular), g^T g = M^T M for M = R^T gate^T (n_embd x n_ff): g's directions are the eigenvectors
    of M M^T = R^T (gate^T gate) R (n_embd x n_embd) carried over by M, v = u^T R^T gate^T / sqrt(mu). Every product
    is n_embd x n_embd or has the k directions kept on one side, so M itself is never formed (on Qwen2.5-1.5B's layers
    0.9 s against 1.4 s; float32 BLAS, the factor and the eigenproblem in float64); ~45x faster than SVDs of x and M."""
    xf = np.asarray(x, dtype=np.float32)
    gw = np.asarray(gate_w, dtype=np.float32)
    c = (xf.T @ xf).astype(np.float64)
    try:
        r = np.linalg.cholesky(c)
    except np.linalg.LinAlgError:
        # a nearly rank-deficient x (a synthetic 7B-shaped model's first layer: 1,225 of 4,096 eigenvalues under 1e-10
        # of the largest) rounds in float32 to an x^T x with negative eigenvalues; in float64 it may still factor (2.6 s
        # there, against 6 s for the eigendecomposition)
        x64 = xf.astype(np.float64)
        c = x64.T @ x64
        del x64
        try:
            r = np.linalg.cholesky(c)
        except np.linalg.LinAlgError:  # x spans fewer than n_embd dimensions (fewer tokens than that, say)
            lam, q = np.linalg.eigh(c)
            r = q * np.sqrt(np.maximum(lam, 0.0))  # r r^T = c as well
    rf = r.astype(np.float32)
    mmt = rf.T @ (gw.T @ gw) @ rf  # M M^T
    mu, u = np.linalg.eigh(mmt.astype(np.float64))
    keep = np.argsort(mu)[::-1]
    keep = keep[mu[keep] > mu[keep[0]] * 1e-12] if mu[keep[0]] > 0 else keep[:1]
    if k is not None:
        keep = keep[:max(1, k)]
    a = u[:, keep].T.astype(np.float32) @ rf.T  # [k, n_embd]: u^T R^T
    vt = (a @ gw.T) / np.sqrt(np.maximum(mu[keep], 1e-300)).astype(np.float32)[:, None]
    return vt.astype(np.float32)


def rrr_init(x: np.ndarray, gate_w: np.ndarray, rank: int, basis: np.ndarray | None = None,
             gate_bias: np.ndarray | None = None) -> Predictor:
    """Reduced-rank regression of g = x gate^T on x, as a relu MLP of width rank (= 2 k); basis: rrr_basis
    of the same x and gate, when the caller has it. gate_bias: a bias added to g (gpt-oss's experts), the
    predictor's output bias."""
    k = max(1, rank // 2)
    vt = rrr_basis(x, gate_w) if basis is None else basis
    v = vt[:k].astype(np.float32)                      # [k, n_ff]
    a = v @ gate_w                                     # [k, n_embd]: h_j = a_j . x
    w1 = np.concatenate([a, -a])
    w2 = np.concatenate([v.T, -v.T], axis=1)
    b2 = np.zeros(gate_w.shape[0], np.float32) if gate_bias is None else np.asarray(gate_bias, np.float32).copy()
    return Predictor(w1.astype(np.float32), np.zeros(2 * k, np.float32), w2.astype(np.float32), b2)


class DecodedDirections:
    """The training-free predictors of every width, as decode holds them, built from one set of directions.

    A width r = 2k predictor is W1 = [A_k; -A_k], W2 = [V_k, -V_k] (rrr_init) over the basis's first k directions, and
    decode's rounding is per W1 row (F16 then Q8_0 over n_embd) and per W2 row of one hidden unit (F16 then w2_type over
    the neurons in slot order): a direction rounds the same in every width, and its negation rounds to the exact
    negation (both quantizers are symmetric). So each direction is rounded once, as the widths grow, and a width's
    validation outputs z = relu(h) V_k^T - relu(-h) V_k^T = h V_k^T (h = x A_k^T) add the new directions' terms to the
    narrower width's (the 7B-shaped dReLU layer: rounding four widths took 5 s of its 29)."""

    def __init__(self, basis: np.ndarray, gate_w: np.ndarray, x_val: np.ndarray, order: np.ndarray | None,
                 w2_type: str, gate_bias: np.ndarray | None) -> None:
        self.basis, self.gate_w, self.x_val, self.w2_type = basis, gate_w, x_val, w2_type
        n_ff, self.n_embd = gate_w.shape
        self.slots = np.arange(n_ff) if order is None else np.asarray(order)
        self.b2 = np.zeros(n_ff, np.float32) if gate_bias is None else np.asarray(gate_bias, np.float32).copy()
        self.a: dict[GGMLQuantizationType, np.ndarray] = {}  # W1's type -> rounded A rows [k, n_embd]
        self.v = np.zeros((n_ff, 0), np.float32)  # rounded V [n_ff, k], model order
        self.h = np.zeros((x_val.shape[0], 0), np.float32)  # x_val A^T with A rounded as W1's type in self.h_type
        self.h_type: GGMLQuantizationType | None = None
        self.z: np.ndarray | None = None  # validation outputs over the first z_k directions (the last width asked)
        self.z_k = 0

    def _rows_a(self, t1: GGMLQuantizationType, k: int) -> np.ndarray:
        a = self.a.get(t1, np.zeros((0, self.n_embd), np.float32))
        if a.shape[0] < k:
            new = decoded_w1(self.basis[a.shape[0]:k].astype(np.float32) @ self.gate_w, t1)
            a = self.a[t1] = np.concatenate([a, new])
        return a[:k]

    def _cols_v(self, t2: GGMLQuantizationType, k: int) -> np.ndarray:
        if self.v.shape[1] < k:
            new = decoded_w2(self.basis[self.v.shape[1]:k].astype(np.float32).T, self.slots, t2)  # [n_ff, dk]
            self.v = np.concatenate([self.v, new], axis=1)
        return self.v[:, :k]

    def predictor(self, rank: int) -> tuple[Predictor, np.ndarray]:
        """The width-`rank` predictor as decode holds it, and its outputs on x_val."""
        k = max(1, rank // 2)
        t1, t2 = fmt.predictor_decode_types(self.n_embd, self.gate_w.shape[0], 2 * k, self.w2_type)
        a, v = self._rows_a(t1, k), self._cols_v(t2, k)
        if self.h_type != t1:  # W1 rounds otherwise at this width (its rank no multiple of 32, or now one): anew
            self.h_type, self.h, self.z, self.z_k = t1, np.zeros((self.x_val.shape[0], 0), np.float32), None, 0
        if self.h.shape[1] < k:
            self.h = np.concatenate([self.h, self.x_val @ a[self.h.shape[1]:k].T], axis=1)
        if self.z is not None and self.z_k <= k:  # the widths are tried narrowest first
            z = self.z + self.h[:, self.z_k:k] @ v[:, self.z_k:k].T
        else:
            z = self.b2 + self.h[:, :k] @ v.T
        self.z, self.z_k = z, k
        w1 = np.concatenate([a, -a])
        w2 = np.concatenate([v, -v], axis=1)
        return Predictor(w1, np.zeros(2 * k, np.float32), w2, self.b2.copy()), z


def train(x: np.ndarray, g: np.ndarray, y: np.ndarray, init: Predictor, epochs: int = EPOCHS, lr: float = LR,
          active_weight: float = ACTIVE_WEIGHT, seed: int = 0) -> Predictor:
    """Adam on sum_i w_i (z_i - g_i)^2 with w = active_weight on active neurons, 1 elsewhere."""
    rng = np.random.default_rng(seed)
    p = [init.w1.copy(), init.b1.copy(), init.w2.copy(), init.b2.copy()]
    m = [np.zeros_like(a) for a in p]
    v = [np.zeros_like(a) for a in p]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    n = x.shape[0]
    step = 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for at in range(0, n, BATCH):
            idx = order[at:at + BATCH]
            xb = np.asarray(x[idx], dtype=np.float32)
            pre = xb @ p[0].T + p[1]
            h = np.maximum(pre, 0.0)
            dz = h @ p[2].T + p[3]
            dz -= g[idx]
            dz *= np.where(y[idx], np.float32(2.0 * active_weight / len(idx)), np.float32(2.0 / len(idx)))
            g2 = dz.T @ h
            gb2 = dz.sum(axis=0)
            dh = dz @ p[2]
            dh *= pre > 0
            g1 = dh.T @ xb
            gb1 = dh.sum(axis=0)
            step += 1
            for i, gr in enumerate((g1, gb1, g2, gb2)):
                m[i] *= beta1
                m[i] += (1 - beta1) * gr
                v[i] *= beta2
                v[i] += (1 - beta2) * gr * gr
                p[i] -= (lr / (1 - beta1 ** step)) * m[i] / (np.sqrt(v[i] / (1 - beta2 ** step)) + eps)
    return Predictor(*p)


def cutoff_for_recall(score: np.ndarray, y: np.ndarray, recall: float) -> float:
    """The largest cutoff at which score > cutoff catches at least `recall` of the active (y) entries."""
    pos = score[y]
    if pos.size == 0:
        return float(np.max(score)) if score.size else 0.0
    k = min(max(int(np.floor((1.0 - recall) * pos.size)), 0), pos.size - 1)  # may miss k actives
    # the k-th smallest by selection, not a sort of them all (Qwen2.5-1.5B: 10M scores a layer, rank and target)
    return float(np.nextafter(np.partition(pos, k)[k], np.float32(-np.inf)))


@dataclass(frozen=True)
class Costs:
    """Bytes one layer's sparse decode step touches per token (the estimate predictor widths are chosen by)."""

    bundle: float  # bytes of one neuron's gate row, up row and down column: its share of a bundle
    w2_type: str = fmt.PREDICTOR_W2_TYPES[0]  # the type decode holds W2 in (pi2.predictor.w2_type)

    def per_token(self, rank: int, n_embd: int, n_ff: int, predicted: float) -> float:
        # the plugin runs W1 in Q8_0 and W2 in w2_type, and reads only the W2 rows of the hidden units relu left
        # non-zero, about half (docs/BACKEND.md). Every predicted neuron counts whole: under a memory budget a
        # bundle is read and cached as one piece, so a neuron the predictor wrongly selects takes its up row and
        # down column from the disk and the cache as well (on real8, a dReLU model, rank 256 against 512 under
        # 380 MB: 0.29 against 0.16 of the neurons predicted, 9.5 against 46 tok/s; docs/MEASUREMENTS.md)
        w1, w2 = (GGML_QUANT_SIZES[t] for t in fmt.predictor_decode_types(n_embd, n_ff, rank, self.w2_type))
        return rank * (n_embd * w1[1] / w1[0] + n_ff / 2 * w2[1] / w2[0]) + n_ff * predicted * self.bundle


@dataclass(frozen=True)
class Fitted:
    predictor: Predictor
    heldout: Quality
    validation: Quality
    tried: tuple[tuple[int, float, float], ...]  # (rank, validation density, estimated bytes/token)
    source: str = DEFAULT_KIND  # svd, trained, or checkpoint (a predictor the model's checkpoint shipped)


def validation_rows(n_train: int) -> int:
    """How many of the last training rows set the cutoff and pick the rank (the others fit)."""
    return max(1, int(n_train * VALIDATION_SHARE))


def fit_layer(score: Callable[[np.ndarray], np.ndarray], threshold: float, gate_w: np.ndarray,
              x_train: np.ndarray, g_train: np.ndarray, x_held: np.ndarray, g_held: np.ndarray,
              ranks: list[int], recall: float, costs: Costs, epochs: int = EPOCHS,
              y_train: np.ndarray | None = None, y_held: np.ndarray | None = None, kind: str = DEFAULT_KIND,
              shipped: Predictor | None = None, gate_bias: np.ndarray | None = None,
              memo: dict[Any, Any] | None = None, order: np.ndarray | None = None) -> Fitted:
    """Makes one predictor per candidate rank (kind svd: reduced-rank regression alone; trained: then
    `epochs` of Adam), narrowest first until a width costs more than the one before it, and keeps the one with the
    fewest estimated bytes read per token (tools reading the sidecar can always fall back to the exact gate). g_* are the gate
    pre-activations of x_* (sparsity.gate_preactivations); a neuron is active where score(g) > threshold,
    unless y_* give the active neurons (method product: those of score(g) > threshold whose |act * up|
    passes too; for kind svd, which fits without labels, y_train may hold the last validation_rows() rows
    only). The cutoff catches `recall` of the active neurons: a neuron the threshold admits but
    that is not active costs nothing when missed. shipped: a predictor the checkpoint came with, one more
    candidate measured the same way (source "checkpoint" when it is the cheapest). gate_bias: the bias g includes
    beyond x gate^T (gpt-oss's experts), or None. memo: a dict shared by calls for the same layer, profile, score and
    options that differ only in the threshold and labels (the sparsity targets of one layer): what does not depend
    on them (the basis, kind svd's predictors and their scores) is computed by the first call and reused.
    order: the layer's bundle-slot order (its neuron ranking; None: model order). Every candidate is weighed as decode
    holds it (Predictor.as_decoded with costs.w2_type), whose W2 rows run over the neurons in that order."""
    xt = np.asarray(x_train, dtype=np.float32)
    n_val = validation_rows(xt.shape[0])
    x_fit, x_val = xt[:-n_val], xt[-n_val:]
    g_fit = g_train[:-n_val]
    y_all = score(g_train) > threshold if y_train is None else y_train
    if y_all.shape[0] == n_val and kind == "svd":  # the caller labelled the validation rows only
        y_fit, y_val = None, y_all
    else:
        y_fit, y_val = y_all[:-n_val], y_all[-n_val:]
    n_ff, n_embd = gate_w.shape
    best: tuple[float, Predictor, Quality, str] | None = None
    tried: list[tuple[int, float, float]] = []
    if kind not in KINDS:
        raise ValueError(f"predictor kind must be one of {', '.join(KINDS)}, got {kind!r}")

    memo = {} if memo is None else memo
    # the rounding of W2 follows the slot order, which the targets of one layer may rank differently
    okey = None if order is None else hashlib.sha1(np.ascontiguousarray(order).tobytes()).hexdigest()

    def weigh(pred: Predictor, source: str, s_val: np.ndarray | None = None) -> None:
        nonlocal best
        if s_val is None:
            s_val = score(pred.outputs(x_val))
        pred.cutoff = cutoff_for_recall(s_val, y_val, recall)
        q = Quality.measure(s_val > pred.cutoff, y_val)
        cost = costs.per_token(pred.rank, n_embd, n_ff, q.density)
        tried.append((pred.rank, q.density, cost))
        if best is None or cost < best[0]:
            best = (cost, pred, q, source)

    if "basis" not in memo:  # the directions the widest candidate uses (a width of r takes r / 2)
        memo["basis"] = rrr_basis(x_fit, gate_w, (max(ranks) + 1) // 2 if ranks else None)
    basis = memo["basis"]
    # widths in increasing order, until one costs more than the narrower one before it: a width's bytes are its
    # predictor's (linear in r) plus the neurons its selection reads, which fall ever more slowly as r grows, so past
    # the cheapest width every wider one costs more
    for r in sorted(ranks):
        if len(tried) >= 2 and tried[-1][2] > tried[-2][2]:
            break
        r = max(2, min(r, 2 * basis.shape[0]))
        if kind == "trained":
            assert y_fit is not None  # only an "svd" caller labels the validation rows alone
            pred = train(x_fit, g_fit, y_fit, rrr_init(x_fit, gate_w, r, basis, gate_bias), epochs=epochs)
            weigh(pred.as_decoded(order, costs.w2_type), kind)
            continue
        if ("svd", r, okey) not in memo:  # the same predictor whatever the labels: its validation scores kept with it
            if ("dirs", okey) not in memo:
                memo["dirs", okey] = DecodedDirections(basis, gate_w, x_val, order, costs.w2_type, gate_bias)
            stored, z = memo["dirs", okey].predictor(r)
            memo["svd", r, okey] = (stored, score(z))
        stored, s_val = memo["svd", r, okey]
        weigh(dataclasses.replace(stored), kind, s_val)
    if shipped is not None:
        weigh(shipped.as_decoded(order, costs.w2_type), "checkpoint")
    assert best is not None
    _, pred, q_val, source = best
    shared = source == "svd" and kind == "svd"  # an svd predictor is one per width: its held-out scores kept too
    held = memo.get(("held", pred.rank, okey)) if shared else None
    if held is None:
        held = score(pred.outputs(x_held))
        if shared:
            memo["held", pred.rank, okey] = held
    q_held = Quality.measure(held > pred.cutoff, score(g_held) > threshold if y_held is None else y_held)
    return Fitted(pred, q_held, q_val, tuple(tried), source)
