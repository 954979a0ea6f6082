#!/usr/bin/env python3
"""Seed corpora for the fuzz targets (tools/fuzz.sh makes them once into build/fuzz/seeds/, keyed by this
script, the converter and the cached models; nothing here is committed).

    .venv/bin/python ggml-backend/fuzz/make_seeds.py OUT_DIR

OUT_DIR/<target>/ gets small inputs (each at most MAX_SEED bytes; all but two sidecars under 64 KiB):
- sidecar: the converted sidecar of a tiny synthetic model (pi2_gguf.converter: synthetic.make, then convert),
  sidecars of tests/sidecar_factory.py (cats, product, relu; 512-byte bundle alignment), the header of SmolLM2's
  cached sidecar with its data cut off, and the tiny model itself (a model given as a sidecar);
- model_summary: the tiny model shrunk (vocabulary cut to 64 tokens, metadata arrays to 8 elements) with each
  stated activation, untied, and the real SmolLM2 and Gemma-3 files shrunk (their metadata, their tensors of
  two layers with every dimension cut to the least their types allow, random data) and as bare headers;
- embedding_rows: untied tiny models whose token embedding is F32, F16, Q8_0 or Q4_K, a tied one, and the shrunk
  real models made untied, each followed by the row-id trailer fuzz_embedding_rows.c reads;
- config: PI2_* settings, good and bad, and FFN tensor names.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType  # noqa: E402

# a sidecar puts each of its 7 tensors per layer at a multiple of 4096 bytes (FORMAT.md): two layers need
# 60 KiB of alignment alone, so the sidecar seeds take up to 128 KiB (fuzz.sh's -max_len for them)
MAX_SEED = 128 * 1024
ALIGN = 32
MODELS = Path.home() / ".cache" / "pi2-gguf" / "models"
SMOL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SIDECAR = MODELS / "SmolLM2-135M-Instruct.Q4_1.pi2.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"

QT = GGMLQuantizationType
VT = GGUFValueType
_SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
           VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}

# (key, value type, value, array element type or None)
KV = tuple[str, VT, object, "VT | None"]


class Tensor:
    def __init__(self, name: str, qtype: int, ne: list[int], data: bytes) -> None:
        self.name, self.qtype, self.ne, self.data = name, int(qtype), [int(x) for x in ne], data


def nbytes(qtype: int, ne: list[int]) -> int:
    blck, size = GGML_QUANT_SIZES[QT(qtype)]
    return math.prod(ne) // blck * size


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _value(vtype: VT, value: object, sub: VT | None) -> bytes:
    if vtype == VT.STRING:
        return _str(value)  # type: ignore[arg-type]
    if vtype == VT.ARRAY:
        assert sub is not None
        items = list(value)  # type: ignore[call-overload]
        return struct.pack("<IQ", int(sub), len(items)) + b"".join(_value(sub, v, None) for v in items)
    return struct.pack(_SCALAR[vtype], value)


def gguf_bytes(kvs: list[KV], tensors: list[Tensor], with_data: bool = True, alignment: int = ALIGN) -> bytes:
    """A GGUF v3 file; with_data False ends it after the header (the tensors' data cut off)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for key, vtype, value, sub in kvs:
        out += _str(key) + struct.pack("<I", int(vtype)) + _value(vtype, value, sub)
    offset = 0
    for t in tensors:
        out += _str(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
        out += struct.pack("<IQ", t.qtype, offset)
        offset += -(-len(t.data) // alignment) * alignment
    if not with_data:
        return bytes(out)
    out += bytes(-len(out) % alignment)
    for t in tensors:
        out += t.data + bytes(-len(t.data) % alignment)
    return bytes(out)


def read_kvs(r: GGUFReader, array_max: int = 8, skip: Iterable[str] = ()) -> list[KV]:
    """The fields of a GGUF, arrays cut to array_max elements (arrays of arrays dropped)."""
    kvs: list[KV] = []
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
        if f.types[0] == VT.ARRAY:
            if len(f.types) > 2 or f.types[1] == VT.ARRAY:
                continue
            kvs.append((name, VT.ARRAY, list(f.contents())[:array_max], f.types[1]))
        else:
            kvs.append((name, f.types[0], f.contents(), None))
    return kvs


def blck(qtype: int) -> int:
    return GGML_QUANT_SIZES[QT(qtype)][0]


def shrink(path: Path, layers: int = 2, embd_rows: int = 8, untie: bool = False, seed: int = 0) -> tuple[list[KV], list[Tensor]]:
    """A real model's metadata and tensors of its first `layers` layers, every dimension cut to the least its
    type allows while the FFN shapes still agree (gate/up n_embd x n_ff, down n_ff x n_embd); random data."""
    r = GGUFReader(path)
    rng = np.random.default_rng(seed)
    kvs = read_kvs(r)
    by_name = {t.name: t for t in r.tensors}
    ffn = [by_name[f"blk.0.ffn_{m}.weight"] for m in ("gate", "up", "down")]
    n_embd = max(math.lcm(blck(ffn[0].tensor_type), blck(ffn[1].tensor_type)), 8)
    n_ff = max(blck(ffn[2].tensor_type), 8)
    tensors: list[Tensor] = []
    for t in r.tensors:
        name = t.name
        if name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        ne = [int(x) for x in t.shape]
        if name.endswith(("ffn_gate.weight", "ffn_up.weight")) and name.startswith("blk."):
            ne = [n_embd, n_ff]
        elif name.endswith("ffn_down.weight") and name.startswith("blk."):
            ne = [n_ff, n_embd]
        else:
            ne = [blck(t.tensor_type)] + [min(x, embd_rows if name == "token_embd.weight" else 2) for x in ne[1:]]
        tensors.append(Tensor(name, t.tensor_type, ne, rng.bytes(nbytes(t.tensor_type, ne))))
    if untie and "output.weight" not in by_name:
        embd = next(t for t in tensors if t.name == "token_embd.weight")
        tensors.append(Tensor("output.weight", embd.qtype, embd.ne, embd.data))
    return kvs, tensors


def header(path: Path) -> bytes:
    """A real file's header (metadata arrays cut to 8 elements, every tensor info as it is), its data cut off."""
    r = GGUFReader(path)
    kvs = read_kvs(r)
    tensors = [Tensor(t.name, t.tensor_type, [int(x) for x in t.shape], b"") for t in r.tensors]
    out = bytearray(gguf_bytes(kvs, tensors, with_data=False))
    # the offsets as the real file has them (gguf_bytes counted empty tensors)
    at = len(b"GGUF") + 20
    for key, vtype, value, sub in kvs:
        at += len(_str(key)) + 4 + len(_value(vtype, value, sub))
    for t in r.tensors:
        at += len(_str(t.name)) + 4 + 8 * len(t.shape) + 4
        out[at:at + 8] = struct.pack("<Q", int(t.data_offset) - _data_start(r))
        at += 8
    return bytes(out)


def _data_start(r: GGUFReader) -> int:
    return min(int(t.data_offset) for t in r.tensors)


def quantize(a: np.ndarray, qtype: int) -> bytes:
    if qtype == QT.F32:
        return a.astype(np.float32).tobytes()
    if qtype == QT.F16:
        return a.astype(np.float16).tobytes()
    from gguf import quants
    try:
        return quants.quantize(a.astype(np.float32), QT(qtype)).tobytes()
    except (quants.QuantError, NotImplementedError):  # gguf-py quantizes only some types: random blocks for the others
        return np.random.default_rng(2).bytes(nbytes(qtype, [a.shape[1], a.shape[0]]))


def tiny_model(work: Path) -> tuple[Path, Path]:
    """A 2-layer synthetic ReLU model (n_embd 32, n_ff 64, Q8_0) and its converted sidecar."""
    from gguf import GGMLQuantizationType

    from pi2_gguf.converter import synthetic
    from pi2_gguf.converter.convert import convert

    model = work / "tiny.gguf"
    synthetic.make(model, synthetic.Shape(n_embd=32, n_ff=64, n_layer=2, n_head=2, n_head_kv=1, n_ctx=256),
                   synthetic.Sparsity(density=0.2), "relu", GGMLQuantizationType.Q8_0, calib_tokens=256,
                   heldout_tokens=64, max_rounds=1, progress=False)
    sidecar = convert(model, work / "tiny.pi2.gguf", train_tokens=512, heldout_tokens=128, bundle_align=512,
                      progress=False).path
    return model, Path(sidecar)


def tiny_variant(model: Path, vocab: int = 64, activation: str | None = "relu", threshold: float | None = None,
                 untie: bool = False, embd_type: int | None = None) -> bytes:
    """The tiny model shrunk to `vocab` tokens, metadata arrays cut to 8, with the activation stated (None:
    no statement), the token embedding re-typed and an output matrix of its own if asked."""
    r = GGUFReader(model)
    skip = {"llama.ffn_activation", "llama.ffn_activation_threshold"}
    kvs = read_kvs(r, skip=skip)
    if activation is not None:
        kvs.append(("llama.ffn_activation", VT.STRING, activation, None))
    if threshold is not None:
        kvs.append(("llama.ffn_activation_threshold", VT.FLOAT32, threshold, None))
    rng = np.random.default_rng(1)
    tensors: list[Tensor] = []
    for t in r.tensors:
        ne = [int(x) for x in t.shape]
        if t.name == "token_embd.weight":
            qt = embd_type if embd_type is not None else int(t.tensor_type)
            n_embd = ne[0] if blck(qt) <= ne[0] else blck(qt)
            ne = [n_embd, vocab]
            tensors.append(Tensor(t.name, qt, ne, quantize(rng.standard_normal((vocab, n_embd)), qt)))
            continue
        tensors.append(Tensor(t.name, t.tensor_type, ne, bytes(np.asarray(t.data).tobytes())))
    if untie:
        e = next(t for t in tensors if t.name == "token_embd.weight")
        tensors.append(Tensor("output.weight", e.qtype, e.ne, e.data))
    return gguf_bytes(kvs, tensors)


def factory_sidecars(work: Path) -> dict[str, bytes]:
    import sidecar_factory as sfac

    out = {}
    for name, kw in {"factory-cats-1layer": dict(n_ff=(32,), rank=(4,), bundle_neurons=2),
                     "factory-product-2layers": dict(n_ff=(16, 24), rank=(4, 8), method="product", bundle_neurons=1),
                     "factory-relu-2layers": dict(n_ff=(24, 16), rank=(8, 4), method="relu", bundle_neurons=4)}.items():
        sc = sfac.build(n_embd=32, bundle_align=512, **kw)  # type: ignore[arg-type]
        out[name] = sfac.write(sc, work / f"{name}.pi2.gguf").read_bytes()
    return out


def trailer(ids: list[int]) -> bytes:
    """The row ids fuzz_embedding_rows.c reads after the file."""
    assert len(ids) < 16
    return struct.pack(f"<{len(ids)}i", *ids) + bytes([len(ids)])


CONFIG_SEEDS = {
    "defaults": "PI2_SPARSE_BATCH=4\nPI2_DOWN_SPARSE_MAX=0.2\nPI2_PROMPT=cpu\nPI2_PREDICTOR=auto\nPI2_ROWS=model\n",
    "flash": "PI2_SIDECAR=/models/m.pi2.gguf\nPI2_MODE=predicted\nPI2_MEMORY_BUDGET=600MB\nPI2_IO_THREADS=32\n"
             "PI2_IO_INFLIGHT_BYTES=2MiB\nPI2_IO_MAX_BYTES=1MiB\nPI2_IO_GAP=32768\nPI2_PREFETCH_BYTES=8M\n"
             "PI2_CACHE_MAX=1GiB\nPI2_COLD_SHARE=0.25\n",
    "bad": "PI2_SPARSE_BATCH=-1\nPI2_DOWN_SPARSE_MAX=2\nPI2_PROMPT=gpu\nPI2_MEMORY_BUDGET=0\nPI2_MODE=sparse\nPI2_NOPE=1\n",
    "sizes": "PI2_MEMORY_BUDGET=1.5e9\nPI2_CACHE_MAX=0x1p40\nPI2_IO_GAP=4 KiB\nPI2_PREFETCH_BYTES=inf\nPI2_IO_MAX_BYTES=1TB\n",
    "modes": "PI2_MODE=dense\nPI2_MODE=oracle\nPI2_SIDECAR=\nPI2_MODE=predicted\n",
    "names": "x=blk.0.ffn_gate.weight\nx=blk.17.ffn_up.weight\nx=blk.1023.ffn_down.weight\nx=blk.1024.ffn_up.weight\n"
             "x=blk.3.ffn_gate_exps.weight\nx=blk.-1.ffn_up.weight\n",
    "numbers": "PI2_SPARSE_BATCH=64\nPI2_IO_THREADS=1e3\nPI2_DOWN_SPARSE_MAX=nan\nPI2_COLD_SHARE=0.9\nPI2_SPARSE_BATCH=0x10\n",
    "long-sidecar": "PI2_MODE=oracle\nPI2_SIDECAR=/" + "m" * 4100 + ".pi2.gguf\n",  # longer than PI2_PATH_MAX
}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[1])
    seeds: dict[str, dict[str, bytes]] = {"sidecar": {}, "model_summary": {}, "embedding_rows": {}, "config": {}}
    with tempfile.TemporaryDirectory(prefix="pi2-seeds-") as tmp:
        work = Path(tmp)
        model, sidecar = tiny_model(work)
        seeds["sidecar"]["tiny-converted.pi2.gguf"] = sidecar.read_bytes()
        factory = factory_sidecars(work)
        for name, data in factory.items():
            seeds["sidecar"][f"{name}.pi2.gguf"] = data
        relu = tiny_variant(model)
        seeds["sidecar"]["tiny-model-as-sidecar.gguf"] = relu
        if SMOL_SIDECAR.exists():
            seeds["sidecar"]["smollm2-sidecar-header.pi2.gguf"] = header(SMOL_SIDECAR)

        ms = seeds["model_summary"]
        ms["tiny-relu.gguf"] = relu
        ms["tiny-fatrelu.gguf"] = tiny_variant(model, activation="fatrelu", threshold=0.01)
        ms["tiny-drelu-untied.gguf"] = tiny_variant(model, activation="drelu", untie=True)
        ms["tiny-silent.gguf"] = tiny_variant(model, activation=None)
        ms["sidecar-as-model.pi2.gguf"] = factory["factory-cats-1layer"]
        er = seeds["embedding_rows"]
        for qt in (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_K):
            er[f"tiny-untied-{qt.name}.gguf"] = tiny_variant(model, untie=True, embd_type=qt) + trailer([0, 5, 63, 64])
        er["tiny-tied.gguf"] = tiny_variant(model) + trailer([1])
        for real, tag in ((SMOL, "smollm2"), (GEMMA, "gemma3")):
            if not real.exists():
                print(f"make_seeds: {real} is not cached; no {tag} seeds", file=sys.stderr)
                continue
            kvs, tensors = shrink(real)
            ms[f"{tag}-shrunk.gguf"] = gguf_bytes(kvs, tensors)
            ms[f"{tag}-header.gguf"] = header(real)
            kvs, tensors = shrink(real, untie=True)
            er[f"{tag}-shrunk-untied.gguf"] = gguf_bytes(kvs, tensors) + trailer([0, 7, 3])
            er[f"{tag}-header.gguf"] = header(real) + trailer([2])
        for name, text in CONFIG_SEEDS.items():
            seeds["config"][name] = text.encode()

        staging = Path(tempfile.mkdtemp(prefix=".seeds-", dir=out.parent if out.parent.exists() else None))
        try:
            for target, files in seeds.items():
                (staging / target).mkdir(parents=True)
                for name, data in files.items():
                    if len(data) > MAX_SEED:
                        print(f"make_seeds: {target}/{name} is {len(data)} bytes, over {MAX_SEED}: cut to its first "
                              f"{MAX_SEED}", file=sys.stderr)
                        data = data[:MAX_SEED]
                    (staging / target / name).write_bytes(data)
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    for target, files in seeds.items():
        sizes = sorted(len(d) for d in files.values())
        print(f"{target}: {len(files)} seeds, {sizes[0]}..{sizes[-1]} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
