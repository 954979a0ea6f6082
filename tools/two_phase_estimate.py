#!/usr/bin/env python3
"""Two-phase against one-phase loading of neuron bundles, from a measured sparse decode: bytes a token
would read from flash if no bundle were cached (every predicted neuron a miss, the cold-cache bound).

One phase (what the plugin does): each predicted neuron's whole bundle (gate, up and down parts).
Two phases (PowerInfer-2): each predicted neuron's gate part first; the up and down parts of the neurons
whose gate fired. Three phases (dReLU): then the down part only of the neurons whose up is positive too.
Each part is read as an O_DIRECT read would take it: from the alignment boundary at or below its start to
the one at or above its end, for 4096 and 512. The counts per token (predicted, fired, active) come from a
predicted-mode decode in RAM of the same model and sidecar; phases add a dependent read per layer.

    .venv/bin/python tools/two_phase_estimate.py MODEL.gguf [--sidecar S] [-n 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pi2_gguf  # noqa: E402
from pi2_gguf.runtime.generate import last_logits  # noqa: E402
from pi2_gguf.sidecar import format as fmt  # noqa: E402
from pi2_gguf.sidecar.reader import read as read_sidecar  # noqa: E402

PROMPT = "The history of the Roman Empire covers the history of ancient Rome from the fall of the Republic"


def span(start: int, end: int, align: int) -> int:
    return -(-end // align) * align - start // align * align


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--sidecar", type=Path)
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sidecar = args.sidecar or fmt.sidecar_path_for(args.model)
    sc = read_sidecar(sidecar)
    llm = pi2_gguf.Llama(str(args.model), sidecar=sidecar, mode="predicted", n_ctx=512, n_threads=args.threads,
                         verbose=False)
    try:
        llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
        pi2_gguf.reset_counters()
        for _ in range(args.n):
            llm.eval([int(np.argmax(last_logits(llm)))])
        c = pi2_gguf.read_counters()
    finally:
        llm.close()
    tok = c.sparse_tokens.astype(float)
    pred, fired, act = c.predicted / tok, c.rows[:, 1] / tok, c.active / tok
    print(f"{args.model.name}, {sidecar.name}: per token, all layers, no bundle cached ({args.n} tokens)")
    print(f"  neurons per token: predicted {pred.sum():.0f}, gate fired {fired.sum():.0f}, active {act.sum():.0f}")
    print("| align | one phase MB | two phases MB | ratio | three phases MB | ratio |")
    print("|---|---|---|---|---|---|")
    for align in (4096, 512):
        one = two = three = 0.0
        for il in range(sc.n_layer):
            lay = sc.layout(il)
            bundle = -(-lay.end // align) * align
            g = span(0, lay.up_offset, align)
            ud = span(lay.up_offset, lay.end, align)
            u = span(lay.up_offset, lay.down_offset, align)
            d = span(lay.down_offset, lay.end, align)
            one += pred[il] * bundle
            two += pred[il] * g + fired[il] * ud
            three += pred[il] * g + fired[il] * u + act[il] * d
        print(f"| {align} | {one / 1e6:.2f} | {two / 1e6:.2f} | {two / one:.2f} | {three / 1e6:.2f} | {three / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
