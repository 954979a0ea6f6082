#!/usr/bin/env python3
"""Writes the model file SmallThinker's own engine streams, from a smallthinker GGUF as make_model writes it.

SmallThinker's engine (the `smallthinker/` llama.cpp fork of github.com/SJTU-IPADS/PowerInfer, built with
`tools/build_peer.py smallthinker`) streams routed experts from an expert bundle only for smallthinker models
whose experts are all Q4_0 and whose `ffn_down_exps` is stored transposed: each expert's down matrix as n_ff rows
of n_embd, the shape of its up and gate matrices ({n_embd, n_ff, n_expert}), instead of the {n_ff, n_embd,
n_expert} stock llama.cpp reads (and refuses in any other shape). So the same weights need two files: the stock
one (stock llama.cpp and pi2) and MODEL-T.gguf for the peer, written by this script: every key and tensor copied
unchanged but `blk.N.ffn_down_exps`, which is dequantized, transposed per expert and quantized to Q4_0 again (its
values then differ from the original's by at most Q4_0's rounding, half a quantization step of their new block).
The input is never modified; the output is written to a temporary file beside it and renamed into place.

With --llama-cli (the engine's binary) it then generates the expert bundle the engine streams from
(`GENERATE_EXPERT_BUNDLE=BUNDLE llama-cli -m MODEL-T.gguf`, which writes it and exits), also atomically, and
prints the peer row's command for `pi2-gguf bench --peer` (docs/OTHER_ENGINES.md).

    tools/peer_model.py st.gguf                                    # writes st-T.gguf
    tools/peer_model.py st.gguf --llama-cli $(tools/build_peer.py smallthinker --source ~/src/PowerInfer)
                                                                   # also st.bundle
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

ARCH = "smallthinker"
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
NOTE_KEY = f"{ARCH}.pi2_peer_note"  # marks the file this script wrote
MIN_CACHED = 512  # MAX_N_CACHED below the engine's I/O queue depth makes it exit
PAGE = 4096  # the engine asserts an expert matrix is a whole number of pages (its bundle is read with O_DIRECT)


class PeerModelError(Exception):
    """The input cannot be made into the engine's model (the message says why)."""


def transposed_path(model: Path) -> Path:
    """MODEL.gguf -> MODEL-T.gguf beside it."""
    return model.with_name(f"{model.stem}-T.gguf")


def bundle_path(model: Path) -> Path:
    """MODEL.gguf -> MODEL.bundle beside it."""
    return model.with_name(f"{model.stem}.bundle")


def _field(reader: GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise PeerModelError(f"{key} is missing")
    return f.contents()


def check_model(reader: GGUFReader, what: str) -> tuple[int, int]:
    """(n_embd, n_ff_exp) of a stock-layout smallthinker model whose expert matrices are all Q4_0 and of a size the
    engine streams; PeerModelError naming the problem otherwise."""
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise PeerModelError(f"{what} is a {arch} model: SmallThinker's engine streams only {ARCH} models")
    if NOTE_KEY in reader.fields:
        raise PeerModelError(f"{what} is already transposed (it has {NOTE_KEY}): give the stock file")
    n_embd = int(_field(reader, f"{ARCH}.embedding_length"))
    n_ff = int(_field(reader, f"{ARCH}.expert_feed_forward_length"))
    ff_key = reader.fields.get(f"{ARCH}.feed_forward_length")
    if ff_key is not None and int(ff_key.contents()) != n_ff:
        # the engine takes a layer for MoE only where feed_forward_length equals the experts' (is_moe)
        raise PeerModelError(f"{what}: feed_forward_length {int(ff_key.contents())} differs from "
                             f"expert_feed_forward_length {n_ff}; the engine would build no MoE layer")
    experts = [t for t in reader.tensors if any(t.name.endswith(f".{m}.weight") for m in EXPERT_MATRICES)]
    if not experts:
        raise PeerModelError(f"{what} has no routed expert tensors ({', '.join(EXPERT_MATRICES)})")
    for t in experts:
        if t.tensor_type != QT.Q4_0:
            raise PeerModelError(f"{what}: {t.name} is {t.tensor_type.name}; the engine's expert bundle holds Q4_0 "
                                 f"experts only (make the model with --type Q4_0)")
        ne = [int(x) for x in t.shape]  # ggml order: ne0 first
        want = [n_ff, n_embd] if t.name.endswith(".ffn_down_exps.weight") else [n_embd, n_ff]
        if ne[:2] != want:
            raise PeerModelError(f"{what}: {t.name} has shape {ne}, not {want + ne[2:]} (already transposed, or "
                                 f"not a stock smallthinker layout)")
    matrix = n_embd // 32 * 18 * n_ff
    if n_embd % 32 or n_ff % 32 or matrix % PAGE:
        raise PeerModelError(f"{what}: an expert matrix of {n_embd} x {n_ff} in Q4_0 is {matrix} bytes, not a whole "
                             f"number of {PAGE}-byte pages, which the engine requires (n_embd * n_ff a multiple of "
                             f"65536)")
    return n_embd, n_ff


def transpose_down(data: np.ndarray, n_embd: int, n_ff: int) -> np.ndarray:
    """A stock ffn_down_exps' Q4_0 bytes [n_expert, n_embd, n_ff/32*18] -> the transposed layout's
    [n_expert, n_ff, n_embd/32*18]: each expert's matrix transposed and quantized to Q4_0 again."""
    values = quants.dequantize(np.asarray(data), QT.Q4_0).reshape(-1, n_embd, n_ff)
    return quants.quantize(np.ascontiguousarray(values.transpose(0, 2, 1)), QT.Q4_0)


def write_transposed(src: Path, dst: Path) -> Path:
    """dst: src's keys and tensors with every ffn_down_exps transposed (transpose_down); written to a temporary file
    in dst's directory, then renamed; src is only read."""
    if src.resolve() == dst.resolve():
        raise PeerModelError(f"the output {dst} is the input: the input is never modified")
    try:
        reader = GGUFReader(src)
    except (ValueError, OSError) as e:
        raise PeerModelError(f"{src} is not a readable GGUF ({e})") from e
    n_embd, n_ff = check_model(reader, str(src))
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        writer = GGUFWriter(tmp, ARCH)
        writer.data_alignment = int(reader.alignment)
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
        writer.add_string(NOTE_KEY, "ffn_down_exps transposed for SmallThinker's engine "
                          "(tools/peer_model.py); stock llama.cpp cannot load this file")
        for t in reader.tensors:
            down = t.name.endswith(".ffn_down_exps.weight")
            shape = [int(x) for x in t.shape]  # ggml order
            if down:
                shape[0], shape[1] = shape[1], shape[0]
            if t.tensor_type in (QT.F32, QT.F16):
                writer.add_tensor_info(t.name, list(reversed(shape)), t.data.dtype, int(t.n_bytes))
            else:  # quantized: the shape of its bytes (numpy order), typed by raw_dtype
                byte_shape = quants.quant_shape_to_byte_shape(tuple(reversed(shape)), t.tensor_type)
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(t.n_bytes), raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:  # one tensor in memory at a time
            data = transpose_down(t.data, n_embd, n_ff) if t.name.endswith(".ffn_down_exps.weight") else t.data
            writer.write_tensor_data(np.asarray(data))
        writer.close()
        tmp.replace(dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


def make_bundle(llama_cli: Path, model_t: Path, bundle: Path, threads: int = 2) -> Path:
    """The engine's expert bundle of model_t (GENERATE_EXPERT_BUNDLE: it loads the model, writes the bundle and exits),
    written to a temporary file beside bundle and renamed."""
    if not llama_cli.is_file():
        raise PeerModelError(f"{llama_cli} is not the engine's llama-cli (tools/build_peer.py smallthinker prints it)")
    tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}.tmp")
    env = dict(os.environ, GENERATE_EXPERT_BUNDLE=str(tmp))
    env.pop("EXPERT_BUNDLE_PATH", None)
    cmd = [str(llama_cli), "-m", str(model_t), "-no-cnv", "-p", "a", "-n", "1", "-t", str(threads)]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0 or "Expert bundle generation done" not in res.stdout or not tmp.is_file():
            raise PeerModelError(f"GENERATE_EXPERT_BUNDLE={tmp} {shlex.join(cmd)} made no bundle (exit "
                                 f"{res.returncode}):\n{res.stdout[-1500:]}{res.stderr[-1500:]}")
        tmp.replace(bundle)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return bundle


def peer_command(llama_cli: Path, model_t: Path, bundle: Path, cached: int) -> str:
    """The --peer NAME=COMMAND argument of `pi2-gguf bench` for this model: the transposed file named literally (the
    bench's {model} is the stock file), its cache of `cached` expert matrices, greedy (--temp 0; the fork's default
    samples at 0.6), micro-batches of 4 as its README runs it."""
    run = (f"env MAX_N_CACHED={cached} EXPERT_BUNDLE_PATH={shlex.quote(str(bundle))} {shlex.quote(str(llama_cli))} "
           f"-m {shlex.quote(str(model_t))} -no-cnv --temp 0 -p {{prompt}} -n {{n}} -t {{threads}} -ub 4")
    return f"smallthinker={run}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a smallthinker GGUF with Q4_0 experts (tools/make_model.py "
                    "--arch smallthinker --type Q4_0)")
    ap.add_argument("-o", "--output", type=Path, help="the transposed file (default: MODEL-T.gguf beside it)")
    ap.add_argument("--llama-cli", type=Path, help="the engine's llama-cli: also generate the expert bundle")
    ap.add_argument("--bundle", type=Path, help="the bundle's path (default: MODEL.bundle beside the model)")
    ap.add_argument("--cached", type=int, default=512, help="MAX_N_CACHED in the printed peer command: expert "
                    "matrices the engine caches (>= 512; each n_embd * n_ff * 18/32 bytes, 3 an expert)")
    args = ap.parse_args(argv)
    if args.cached < MIN_CACHED:
        ap.error(f"--cached {args.cached}: the engine exits on a MAX_N_CACHED under its I/O queue depth, {MIN_CACHED}")
    out = args.output or transposed_path(args.model)
    try:
        write_transposed(args.model, out)
        print(f"wrote {out}", file=sys.stderr)
        if args.llama_cli is not None:
            bundle = make_bundle(args.llama_cli.resolve(), out, args.bundle or bundle_path(args.model))
            print(f"wrote {bundle}", file=sys.stderr)
            print(peer_command(args.llama_cli.resolve(), out.resolve(), bundle.resolve(), args.cached))
    except PeerModelError as e:
        print(f"peer_model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
