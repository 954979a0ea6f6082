"""Activation profiling: runs a model over real text and records, per layer, the FFN input x of every
profiled token (the output of the FFN norm, llama.cpp's graph tensor "ffn_norm-N").

Per-neuron activation values are act(gate_i . x): the sparsity module recomputes them from x and the
layer's gate weights, so a profile serves any sparsity target or threshold without running the
model again. Memory is bounded by the token budget (arrays are preallocated), whatever the corpus
length; documents are streamed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..assets import corpus as corpus_mod
from ..errors import OutputWriteError, Pi2Error
from ..gguf_file import check_context, check_model_file, expert_used_count, gguf_architecture
from ..paths import read_head

FFN_INPUT = "ffn_norm"
# architectures whose graph names the FFN input otherwise (llama.cpp's src/models/*.cpp, the cb() of the norm
# the FFN multiplies): GLM-4.5's post-attention norm, gpt-oss's
FFN_INPUT_OF_ARCH = {"glm4moe": "post_attn_norm", "gpt-oss": "attn_post_norm"}
ROUTER_LOGITS = "ffn_moe_logits"  # MoE: the router's logits, whose top n_expert_used are the routed experts
DEFAULT_TRAIN_TOKENS = 8192  # the most a default profile takes


def default_train_tokens(n_embd: int, moe: bool = False) -> int:
    """Training tokens of a default profile. Dense: 2 per input dimension, 2,048 to 8,192: the dReLU real8 model
    (n_embd 2,048) fitted predictors as precise from 4,096 as from 8,192 (held-out predicted density 0.289 against
    0.288, recall 0.989-0.990) and Qwen2.5-Coder-1.5B and SmolLM2 chose the same sparsity and bytes from 2,048, while
    profiling and the products planning takes on the profile are most of convert's time (docs/MEASUREMENTS.md,
    2026-11-29). MoE: 4 per input dimension, 4,096 to 8,192, as an expert sees only the tokens routed to it."""
    per, least = (4, 4096) if moe else (2, 2048)
    return min(DEFAULT_TRAIN_TOKENS, max(least, per * n_embd))


def default_heldout_tokens(moe: bool = False) -> int:
    """Held-out tokens of a default profile (the density and predictor quality a sidecar records): 1,024 for a dense
    model (n_ff values a token: 9M on Qwen2.5-1.5B's layers), 2,048 for MoE, whose experts see a share of them."""
    return 2048 if moe else 1024


MIN_ROUTED = 32  # an expert routed fewer profile tokens is profiled on all of its layer's
DEFAULT_WINDOW = 256


# the names of a profile's per-layer arrays (Profile.arrays)
_LAYER_ARRAY = re.compile(r"train_[0-9]+")
_ROUTES_ARRAY = re.compile(r"train_routes_[0-9]+")


class ProfileError(Pi2Error):
    """A profile file is unreadable or does not belong to the model."""


def expert_reuse(routes: np.ndarray, n_expert: int, window: int) -> list[float]:
    """Per expert of one layer: of the tokens routed to it, the share whose next token is routed to it too (0 where
    none was). routes: [n_tokens, n_used], tokens in windows of `window` consecutive tokens of text (run_profile);
    pairs across a window boundary are not consecutive text and are left out."""
    chosen = np.zeros((routes.shape[0], n_expert), dtype=bool)
    np.put_along_axis(chosen, routes.astype(np.int64), True, axis=1)
    consecutive = (np.arange(routes.shape[0] - 1) % window) != window - 1
    now, then = chosen[:-1][consecutive], chosen[1:][consecutive]
    n = now.sum(axis=0)
    return [float((now[:, e] & then[:, e]).sum() / n[e]) if n[e] else 0.0 for e in range(n_expert)]


@dataclass
class Profile:
    model_file: str
    model_size: int
    corpus: str
    corpus_sha256: str
    window: int
    train: list[np.ndarray]    # per layer [n_train, n_embd] float16
    heldout: list[np.ndarray]  # per layer [n_heldout, n_embd] float16
    # MoE: per layer the routed experts of each token, [n, n_expert_used] int16 (empty for dense models)
    train_routes: list[np.ndarray] = field(default_factory=list)
    heldout_routes: list[np.ndarray] = field(default_factory=list)
    # an expert view (experts()): the training and held-out tokens of the profile it was made from
    routed_from: tuple[int, int] | None = None
    # an expert view: per (layer, expert), the share of the layer's training tokens routed to it, and of the tokens
    # routed to it the share whose next token (in the same window of text) is routed to it too
    expert_share: list[float] | None = None
    expert_reuse: list[float] | None = None

    @classmethod
    def unprofiled(cls, model: Path, corpus: str, corpus_sha256: str, n_layer: int, n_embd: int) -> Profile:
        """No tokens profiled: the profile of a convert that plans no layer (every FFN layer read whole)."""
        empty = [np.zeros((0, n_embd), np.float16) for _ in range(n_layer)]
        return cls(model_file=model.name, model_size=model.stat().st_size, corpus=corpus, corpus_sha256=corpus_sha256,
                   window=0, train=empty, heldout=list(empty))

    @property
    def n_layer(self) -> int:
        return len(self.train)

    @property
    def n_embd(self) -> int:
        return int(self.train[0].shape[1])

    @property
    def n_train(self) -> int:
        return self.routed_from[0] if self.routed_from else int(self.train[0].shape[0])

    @property
    def n_heldout(self) -> int:
        return self.routed_from[1] if self.routed_from else int(self.heldout[0].shape[0])

    def save(self, path: str | Path) -> Path:
        """Writes an .npz atomically."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        # Any: numpy's stub would match **arrays against savez's allow_pickle: bool too
        arrays: dict[str, Any] = self.arrays()
        meta = np.array([self.model_file, str(self.model_size), self.corpus, self.corpus_sha256, str(self.window)])
        try:
            with tmp.open("wb") as f:
                np.savez(f, meta=meta, **arrays)
            tmp.replace(p)
        except OSError as e:
            raise OutputWriteError(f"cannot write profile {p}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)
        return p

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p, magic = read_head(path, "profile", ProfileError)
        if magic != b"PK\x03\x04":
            raise ProfileError(f"{p} is not a pi2 profile (an .npz file written by `pi2-gguf profile`)")
        try:
            with np.load(p, allow_pickle=False) as z:
                meta = [str(s) for s in z["meta"]]
                arrays = {k: z[k] for k in z.files if k != "meta"}
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise ProfileError(f"{p} is not a readable pi2 profile: {e}") from e
        if "train_0" not in arrays:
            raise ProfileError(f"{p} holds no layers")
        try:
            return cls.from_arrays(meta[0], int(meta[1]), meta[2], meta[3], int(meta[4]), arrays)
        except (IndexError, KeyError, ValueError) as e:
            raise ProfileError(f"{p} is not a readable pi2 profile: {e}") from e

    def arrays(self) -> dict[str, np.ndarray]:
        """Its per-layer arrays by the names a profile file holds them under (train_i, heldout_i and, for an MoE
        model, train_routes_i, heldout_routes_i): what save() writes and convert's work directory keeps."""
        arrays = {f"train_{i}": a for i, a in enumerate(self.train)}
        arrays.update({f"heldout_{i}": a for i, a in enumerate(self.heldout)})
        arrays.update({f"train_routes_{i}": a for i, a in enumerate(self.train_routes)})
        arrays.update({f"heldout_routes_{i}": a for i, a in enumerate(self.heldout_routes)})
        return arrays

    @classmethod
    def from_arrays(cls, model_file: str, model_size: int, corpus: str, corpus_sha256: str, window: int,
                    arrays: Mapping[str, np.ndarray]) -> Profile:
        """The profile whose arrays() these are (KeyError where a layer's array is missing, ValueError where there is
        no layer)."""
        n = sum(1 for k in arrays if _LAYER_ARRAY.fullmatch(k))
        n_routed = sum(1 for k in arrays if _ROUTES_ARRAY.fullmatch(k))
        if n == 0:
            raise ValueError("no layers")
        return cls(model_file, model_size, corpus, corpus_sha256, window,
                   [arrays[f"train_{i}"] for i in range(n)], [arrays[f"heldout_{i}"] for i in range(n)],
                   [arrays[f"train_routes_{i}"] for i in range(n_routed)],
                   [arrays[f"heldout_routes_{i}"] for i in range(n_routed)])

    def experts(self, layer_experts: list[int], n_expert: int, skip: frozenset[int] = frozenset()) -> Profile:
        """The profile of an MoE model's sidecar layers (FORMAT.md, "MoE sidecars"): per model layer of n_expert
        routed experts (layer_experts[il] n_expert, or n_expert + 1 with a shared expert) one layer per expert, which
        gets the inputs of the tokens routed to it (all the layer's tokens where fewer than MIN_ROUTED were); a
        dense FFN layer (0) and a shared expert are one layer of every token, their routed share and reuse 1.
        skip: sidecar layers whose inputs nobody reads (routed experts read whole: nothing is planned for them) get
        none, a view of no rows: every token is routed to k experts, so the copies would be k times the profile
        (16 GB on a Qwen3-30B-A3B-shaped model's 10,240 tokens, OOM on 24 GB)."""
        if not self.train_routes:
            raise ProfileError("the profile has no routing (made before MoE support, or of a dense model): profile again")
        for il, (count, r) in enumerate(zip(layer_experts, self.train_routes)):
            if count and r.shape[0] != self.train[il].shape[0]:
                raise ProfileError(f"the profile has no routing for layer {il}, which routes to {n_expert} experts")

        def pick(xs: list[np.ndarray], routes: list[np.ndarray]) -> list[np.ndarray]:
            out: list[np.ndarray] = []
            for x, r, count in zip(xs, routes, layer_experts):
                for e in range(n_expert if count else 0):
                    if len(out) in skip:
                        out.append(x[:0])
                        continue
                    rows = (r == e).any(axis=1)
                    out.append(x[rows] if rows.sum() >= MIN_ROUTED else x)
                if count != n_expert:  # a dense FFN layer, or the shared expert after the routed ones
                    out.append(x)
            return out

        share: list[float] = []
        reuse: list[float] = []
        for r, count in zip(self.train_routes, layer_experts):
            if count:
                share += [float((r == e).any(axis=1).mean()) for e in range(n_expert)]
                reuse += expert_reuse(r, n_expert, self.window)
            if count != n_expert:
                share.append(1.0)
                reuse.append(1.0)
        return Profile(self.model_file, self.model_size, self.corpus, self.corpus_sha256, self.window,
                       pick(self.train, self.train_routes), pick(self.heldout, self.heldout_routes),
                       routed_from=(self.n_train, self.n_heldout), expert_share=share, expert_reuse=reuse)

    def check_model(self, model_path: Path) -> None:
        size = model_path.stat().st_size
        if Path(self.model_file).name != model_path.name or size != self.model_size:
            raise ProfileError(f"the profile was made for {self.model_file} ({self.model_size} bytes), "
                               f"not {model_path} ({size} bytes)")


def routed_experts(logits: np.ndarray, k: int) -> np.ndarray:
    """Each token's k routed experts from its router logits [n_tok, n_expert] (softmax keeps their order)."""
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


class _Recorder:
    """Receives the FFN inputs (ffn_norm-N, or the architecture's name for them) and stores them in preallocated
    per-layer arrays; for an MoE model also the routed experts of each token (the top n_expert_used of
    ffn_moe_logits-N; none on a dense FFN layer among routed ones)."""

    def __init__(self, n_layer: int, n_embd: int, capacity: int, n_expert_used: int = 0) -> None:
        self.arrays = [np.empty((capacity, n_embd), dtype=np.float16) for _ in range(n_layer)]
        self.filled = [0] * n_layer
        self.k = n_expert_used
        self.routes = [np.empty((capacity, n_expert_used), dtype=np.int16) for _ in range(n_layer)] if n_expert_used else []
        self.routed = [0] * n_layer

    def __call__(self, layer: int, name: str, x: np.ndarray) -> None:
        if name == ROUTER_LOGITS:
            if self.k == 0 or layer >= len(self.routes):
                raise Pi2Error(f"graph has router logits {name}-{layer}, but the model reports no experts there")
            at = self.routed[layer]
            self.routes[layer][at:at + x.shape[0]] = routed_experts(x, self.k)
            self.routed[layer] = at + x.shape[0]
            return
        if layer >= len(self.arrays):
            raise Pi2Error(f"graph has FFN layer {layer}, the model reports {len(self.arrays)}")
        a, at = self.arrays[layer], self.filled[layer]
        if x.shape[1] != a.shape[1]:
            raise Pi2Error(f"{name}-{layer} has width {x.shape[1]}, expected n_embd {a.shape[1]}")
        a[at:at + x.shape[0]] = x  # callers never hand out more tokens than the capacity
        self.filled[layer] = at + x.shape[0]

    def result(self) -> list[np.ndarray]:
        n = min(self.filled)
        if max(self.filled) != n:
            raise Pi2Error(f"layers saw different token counts ({min(self.filled)}..{max(self.filled)}): "
                           "the graph pruned tokens before an FFN")
        return [a[:n] for a in self.arrays]

    def routes_result(self) -> list[np.ndarray]:
        """Per layer the routed experts of each token; [0, k] for a layer without a router (a dense FFN layer)."""
        n = min(self.filled)
        if self.k and any(r not in (0, n) for r in self.routed):
            raise Pi2Error(f"router logits were seen for {min(self.routed)}..{max(self.routed)} tokens, FFN inputs for {n}")
        if self.k and not any(self.routed):
            raise Pi2Error("the model has routed experts, but no layer's router logits were seen")
        return [r[:n] if at else r[:0] for r, at in zip(self.routes, self.routed)]


def run_profile(model_path: str | Path, corpus: corpus_mod.Corpus, train_tokens: int | None = None,
                heldout_tokens: int | None = None, window: int = DEFAULT_WINDOW,
                threads: int | None = None, progress: bool = True,
                tick: Callable[[int], str | None] | None = None) -> Profile:
    """train_tokens, heldout_tokens: None for the defaults (default_train_tokens, default_heldout_tokens). tick: called
    with the tokens of each window profiled; a string it returns is shown beside the bar (convert's time left)."""
    from ..runtime.runner import LlamaRunner

    path = check_model_file(model_path)
    # the default window is capped to a shorter training context (small synthetic models), a given one refused
    window = check_context(path, None if window == DEFAULT_WINDOW else window, "--window", DEFAULT_WINDOW)
    if (train_tokens is not None and train_tokens < 64) or (heldout_tokens is not None and heldout_tokens < 16):
        raise Pi2Error(f"token budget too small: {train_tokens} training / {heldout_tokens} held-out tokens "
                       "(need at least 64 / 16)")
    train_docs, held_docs = corpus.split()
    parts: dict[str, list[np.ndarray]] = {}
    routes: dict[str, list[np.ndarray]] = {}
    current: list[_Recorder] = []
    k = expert_used_count(path)  # from the header: gguf-py's reader would build the whole vocabulary first
    ffn_input = FFN_INPUT_OF_ARCH.get(gguf_architecture(path) or "", FFN_INPUT)
    if k:
        # the plugin computes the activation the model states: llama.cpp's MoE graph alone computes SwiGLU for
        # llama/qwen3moe experts, so a ReLU-family model's later layers would see other inputs
        from .. import register

        register()
    # without repacked weights: prompt windows of the 1.5B dReLU model (Q4_K) ran at 120 tok/s against 74
    # with them (tools/bench_sparse.py, 2026-11-24), and profiling is all prompt windows
    runner = LlamaRunner(path, n_ctx=window, n_threads=threads, watch=(ffn_input, ROUTER_LOGITS) if k else (ffn_input,),
                         repack=False,
                         sink=lambda layer, name, x: current[-1](layer, name, x))
    if train_tokens is None:
        train_tokens = default_train_tokens(runner.n_embd, moe=bool(k))
    if heldout_tokens is None:
        heldout_tokens = default_heldout_tokens(moe=bool(k))
    try:
        # the recorded FFN inputs stay in RAM (float16): refuse a token budget they cannot fit in
        need = (train_tokens + heldout_tokens) * runner.n_layer * runner.n_embd * 2
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > ram:
            raise Pi2Error(f"--train-tokens {train_tokens} + --heldout-tokens {heldout_tokens}: the profile of "
                           f"{path.name} would hold {need / 1e9:.1f} GB in memory, more than this machine's "
                           f"{ram / 1e9:.1f} GB")
        for phase, docs, budget in (("train", train_docs, train_tokens), ("heldout", held_docs, heldout_tokens)):
            if sum(len(d) for d in docs) < 1 << 16:  # a short text: count its tokens before profiling starts
                got = sum(len(runner.tokenize(d + "\n\n")) for d in docs) + runner.add_bos
                if got < min(budget, 16):
                    raise Pi2Error(f"the corpus {corpus.name} gives only {got} {phase} tokens (16 at least)")
        for phase, docs, budget in (("train", train_docs, train_tokens), ("heldout", held_docs, heldout_tokens)):
            current.append(_Recorder(runner.n_layer, runner.n_embd, budget, k))
            with tqdm(total=budget, unit="tok", desc=f"profile {phase}", disable=not progress) as bar:
                for w in runner.windows(docs, budget):
                    runner.decode(w)
                    if tick is not None:
                        post = tick(len(w))
                        if post:
                            bar.set_postfix_str(post, refresh=False)
                    bar.update(len(w))
            recorded = current[-1].result()
            if recorded[0].shape[0] < min(budget, 16):
                raise Pi2Error(f"the corpus {corpus.name} gave only {recorded[0].shape[0]} {phase} tokens")
            parts[phase] = recorded
            routes[phase] = current[-1].routes_result()
    finally:
        runner.close()
    return Profile(path.name, path.stat().st_size, corpus.name, corpus.sha256, window,
                   parts["train"], parts["heldout"], routes["train"], routes["heldout"])
