#!/usr/bin/env python3
"""How well an MoE model's next-layer experts can be guessed before its router runs (PI2_EXPERT_GUESS).

Runs held-out corpus text through the model (with the plugin, which computes the activation the model states)
and, per layer, applies the NEXT layer's router (blk.N+1.ffn_gate_inp.weight, read from the GGUF) to this layer's
FFN input: the share of the next layer's top-k experts that guess picks, against chance (k / n_expert) and against
the same layer's choice for the previous token. The plugin reads guesses only while at least 80% are right
(docs/BACKEND.md, "The next layer's experts are guessed"), so this says whether a model will use them.

    .venv/bin/python tools/expert_guess.py MODEL.gguf [-n 400]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pi2_gguf.bench import heldout_text  # noqa: E402
from pi2_gguf.converter.profile import routed_experts  # noqa: E402
from pi2_gguf.converter.synthetic_moe import routing_profile  # noqa: E402
from pi2_gguf.runtime.runner import LlamaRunner  # noqa: E402


def routers(path: Path) -> dict[int, np.ndarray]:
    """Each layer's router as [n_expert, n_embd] f32."""
    out: dict[int, np.ndarray] = {}
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".ffn_gate_inp.weight"):
            out[int(t.name.split(".")[1])] = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
    return out


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean share of each row of b found in the same row of a (rows are top-k sets)."""
    return float(np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, b)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("-n", type=int, default=400, help="held-out tokens (default 400)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.model.is_file():
        ap.error(f"{args.model}: no such file")
    w = routers(args.model)
    if len(w) < 2:
        ap.error(f"{args.model}: not an MoE model with routers (blk.N.ffn_gate_inp.weight) in two layers or more")
    reader = GGUFReader(args.model)
    arch = reader.get_field("general.architecture").contents()
    used = reader.get_field(f"{arch}.expert_used_count")
    if used is None:
        ap.error(f"{args.model}: no {arch}.expert_used_count")
    n_used = int(used.contents())
    with LlamaRunner(args.model, n_ctx=64) as r:  # tokens only
        tokens = r.tokenize(heldout_text(args.n))[:args.n]
    layers = sorted(w)
    xs, lg = routing_profile(args.model, tokens, layers[-1] + 1, args.threads, str(arch))
    n_expert = w[layers[0]].shape[0]
    print(f"{args.model.name}: {len(layers)} MoE layers, top-{n_used} of {n_expert} experts, {args.n} held-out tokens")
    print("layer | next layer's top-k the guess picks | the same layer's previous token's experts")
    guesses, reuse = [], []
    for il in layers:
        routed = routed_experts(lg[il], n_used)
        reuse.append(overlap(routed[:-1], routed[1:]))
        if il + 1 in w:
            guesses.append(overlap(routed_experts(xs[il] @ w[il + 1].T, n_used), routed_experts(lg[il + 1], n_used)))
        print(f"{il:5d} | {guesses[-1] if il + 1 in w else float('nan'):33.3f} | {reuse[-1]:.3f}")
    print(f"mean  | {np.mean(guesses):33.3f} | {np.mean(reuse):.3f}   (chance {n_used / n_expert:.3f}; the plugin reads "
          f"guesses while >= 0.8 are right)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
