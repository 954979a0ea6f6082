"""The C sidecar reader (ggml-backend/src/model/sidecar.c) against sidecars written with gguf.GGUFWriter as
docs/FORMAT.md says: a valid one is accepted by it and by gguf.GGUFReader, and each error FORMAT.md
lists is refused with a message naming the sidecar and the problem. The C fingerprint is checked
against the Python one and against a direct transcription of FORMAT.md."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from pi2_gguf.errors import SidecarError
from pi2_gguf.runtime.native import (
    check_sidecar_weight_c,
    fingerprint_model_c,
    fingerprint_tensor_c,
    sidecar_summary_c,
    validate_sidecar_c,
)
from pi2_gguf.sidecar import format as sf
from pi2_gguf.sidecar.reader import read as read_sidecar

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
import sidecar_factory as factory  # noqa: E402


def _refused(path: Path) -> str:
    with pytest.raises(SidecarError) as e:
        validate_sidecar_c(path)
    msg = str(e.value)
    assert msg.startswith(f"sidecar {path}: "), msg
    return msg


_CHILD = """
import json, sys
from pi2_gguf.errors import SidecarError
from pi2_gguf.runtime.native import validate_sidecar_c
out = []
for p in sys.argv[1:]:
    try:
        validate_sidecar_c(p)
        out.append("OK")
    except SidecarError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def _validate_in_child(paths: list[Path]) -> list[str]:
    """The C validator on each file in a separate process, so a crash fails the test instead of pytest."""
    r = subprocess.run([sys.executable, "-c", _CHILD, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"validator process died (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture()
def valid(tmp_path: Path) -> tuple[factory.Sidecar, Path]:
    sc = factory.build()
    return sc, factory.write(sc, tmp_path / "valid.pi2.gguf")


# --- the valid sidecar -------------------------------------------------------------------------


def test_valid_sidecar_passes_c_reader(valid: tuple[factory.Sidecar, Path]) -> None:
    sc, path = valid
    validate_sidecar_c(path)
    n_layer, fp = sidecar_summary_c(path)
    assert n_layer == 2
    assert fp == sc.get("pi2.source.fingerprint") == sf.model_fingerprint(sc.get("pi2.source.tensor_fingerprints"))


def test_valid_sidecar_reads_with_gguf_py(valid: tuple[factory.Sidecar, Path]) -> None:
    sc, path = valid
    r = GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "pi2"
    assert r.fields["general.alignment"].contents() == 4096
    scalar = {sf.KT.U32: GGUFValueType.UINT32, sf.KT.U64: GGUFValueType.UINT64, sf.KT.F32: GGUFValueType.FLOAT32,
              sf.KT.STR: GGUFValueType.STRING}
    element = {sf.KT.U32_ARR: GGUFValueType.UINT32, sf.KT.U64_ARR: GGUFValueType.UINT64,
               sf.KT.F32_ARR: GGUFValueType.FLOAT32}
    assert set(sf.KEYS) - set(sf.keys_of("cats")) == {"pi2.sparsity.product_thresholds"}
    assert "pi2.sparsity.product_thresholds" not in r.fields
    for key, kt in sf.keys_of("cats").items():
        f = r.fields[key]
        if kt in scalar:
            assert f.types == [scalar[kt]], key
        else:
            assert f.types == [GGUFValueType.ARRAY, element[kt]], key
            assert len(f.data) == (3 if key == "pi2.source.tensor_fingerprints" else 1) * 2, key
    assert r.fields["pi2.n_ff"].contents() == [96, 128]
    assert r.fields["pi2.source.tensor_fingerprints"].contents() == sc.get("pi2.source.tensor_fingerprints")
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * len(sf.TENSORS)
    for t in r.tensors:
        assert t.data_offset % 4096 == 0, t.name
    b = tensors["blk.1.pi2_bundles"]
    assert [int(x) for x in b.shape] == [4096, 128]  # ggml order (bundle size, n_ff)
    assert b.tensor_type.name == "I8"
    w1 = tensors["blk.1.pi2_pred_w1"]
    assert [int(x) for x in w1.shape] == [64, 16] and w1.tensor_type.name == "F16"
    # bundle slot 0 holds neuron order[0]: its gate row, up row, down column, then zeros
    order = np.asarray(tensors["blk.1.pi2_order"].data)
    gate, up, down = sc.weights[1]
    slot = np.asarray(b.data)[0].view(np.uint8)
    i = int(order[0])
    assert slot[:128].tobytes() == gate[i].tobytes()
    assert slot[128:256].tobytes() == up[i].tobytes()
    assert slot[256:384].tobytes() == np.ascontiguousarray(down[:, i]).tobytes()
    assert not slot[384:].any()


def test_check_weight_accepts_the_source_model_and_refuses_another(valid: tuple[factory.Sidecar, Path]) -> None:
    sc, path = valid
    for il, nf in enumerate(sc.n_ff):
        for m, w in enumerate(sc.weights[il]):
            check_sidecar_weight_c(path, il, m, factory.F16, *factory.weight_shape(m, 64, nf), w)

    other = sc.weights[1][1].copy()
    other[0, 0] += 1  # byte 0 is in the first sample
    with pytest.raises(SidecarError) as e:
        check_sidecar_weight_c(path, 1, 1, factory.F16, 64, 128, other)
    msg = str(e.value)
    assert msg.startswith(f"sidecar {path}: was made for another model (fingerprint of blk.1.ffn_up.weight differs: ")
    assert f"0x{sf.tensor_fingerprint(factory.F16, 64, 128, other):016x} in the model" in msg
    assert f"0x{sc.get('pi2.source.tensor_fingerprints')[4]:016x} in the sidecar" in msg

    with pytest.raises(SidecarError, match=r"blk\.0\.ffn_down\.weight is 100 x 64 in the model, 96 x 64 in the llama model"):
        check_sidecar_weight_c(path, 0, 2, factory.F16, 100, 64, np.zeros((64, 100), np.float16))
    with pytest.raises(SidecarError, match=r"fingerprint of blk\.0\.ffn_gate\.weight differs: .* in the model \(q8_0\)"):
        check_sidecar_weight_c(path, 0, 0, 8, 64, 96, sc.weights[0][0])  # same bytes, other type
    with pytest.raises(SidecarError, match=r"it has 2 FFN layers; the model has blk\.2\.ffn_gate\.weight"):
        check_sidecar_weight_c(path, 2, 0, factory.F16, 64, 96, sc.weights[0][0])


# --- fingerprint --------------------------------------------------------------------------------


def _fnv(data: bytes, h: int = 0xCBF29CE484222325) -> int:
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def _fingerprint_from_doc(qtype: int, ne0: int, ne1: int, raw: bytes) -> int:
    """FORMAT.md "Fingerprint", transcribed directly: header, then the 16 samples concatenated."""
    n = len(raw)
    s = min(256, n)
    stream = struct.pack("<IQQQ", qtype, ne0, ne1, n)
    stream += b"".join(raw[k * (n - s) // 15:k * (n - s) // 15 + s] for k in range(16))
    return _fnv(stream)


def test_fnv_reference_vectors() -> None:
    # published FNV-1a 64 test vectors, so the transcription above is itself checked
    assert _fnv(b"") == 0xCBF29CE484222325
    assert _fnv(b"a") == 0xAF63DC4C8601EC8C
    assert _fnv(b"foobar") == 0x85944171F73967E8


@pytest.mark.parametrize("nbytes", [0, 1, 15, 100, 255, 256, 257, 3839, 3840, 3841, 4096 + 13, 1 << 20])
@pytest.mark.parametrize("qtype", [0, 1, 8, 12, 30])
def test_c_fingerprint_equals_python_and_doc(nbytes: int, qtype: int) -> None:
    rng = np.random.default_rng(nbytes * 31 + qtype)
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ne0, ne1 = int(rng.integers(1, 1 << 40)), int(rng.integers(1, 1 << 20))
    c = fingerprint_tensor_c(qtype, ne0, ne1, raw)
    assert c == sf.tensor_fingerprint(qtype, ne0, ne1, raw)
    assert c == _fingerprint_from_doc(qtype, ne0, ne1, raw.tobytes())


def test_fingerprint_small_tensor_hashes_all_bytes_16_times() -> None:
    raw = bytes(range(7))
    expected = _fnv(struct.pack("<IQQQ", 1, 7, 1, 7) + raw * 16)
    assert fingerprint_tensor_c(1, 7, 1, raw) == expected == sf.tensor_fingerprint(1, 7, 1, np.frombuffer(raw, np.uint8))


def test_fingerprint_sees_header_and_samples_only() -> None:
    raw = np.zeros(256 + 15 * 1024, dtype=np.uint8)  # samples of 256 bytes every 1024 bytes
    base = fingerprint_tensor_c(1, 10, 20, raw)
    assert fingerprint_tensor_c(1, 10, 21, raw) != base
    assert fingerprint_tensor_c(2, 10, 20, raw) != base
    changed = raw.copy()
    changed[1024 * 3 + 255] = 1  # last byte of sample 3
    assert fingerprint_tensor_c(1, 10, 20, changed) != base
    changed = raw.copy()
    changed[1024 * 3 + 256] = 1  # between samples 3 and 4
    assert fingerprint_tensor_c(1, 10, 20, changed) == base


def test_c_model_fingerprint_equals_python() -> None:
    fps = [int(x) for x in np.random.default_rng(5).integers(0, 2**63, 30, dtype=np.uint64) * 2 + 1]
    assert fingerprint_model_c(fps) == sf.model_fingerprint(fps)
    assert fingerprint_model_c([]) == 0xCBF29CE484222325


# --- refusals -----------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    assert "cannot open: No such file or directory" in _refused(tmp_path / "nope.pi2.gguf")


def test_not_gguf_and_truncated_files_in_a_child(valid: tuple[factory.Sidecar, Path], tmp_path: Path) -> None:
    _, path = valid
    data = path.read_bytes()
    data_start = GGUFReader(path).tensors[0].data_offset
    last = GGUFReader(path).tensors[-1]
    cases = {
        "text": b"this is not a gguf file\n" * 10,
        "empty": b"",
        "cut_in_header": data[:200],
        "cut_after_header": data[:data_start - 1000],
        "cut_in_data": data[:last.data_offset + 100],
        "cut_one_byte": data[:-1],
    }
    paths = []
    for name, blob in cases.items():
        p = tmp_path / f"{name}.pi2.gguf"
        p.write_bytes(blob)
        paths.append(p)
    msgs = dict(zip(cases, _validate_in_child(paths)))
    for name, p in zip(cases, paths):
        assert msgs[name].startswith(f"sidecar {p}: "), msgs[name]
    assert "is not a GGUF file" in msgs["text"] and "is not a GGUF file" in msgs["empty"]
    assert "is not a readable GGUF file: its header is corrupt or truncated" in msgs["cut_in_header"]
    assert "is not a readable GGUF file" in msgs["cut_after_header"]
    assert f"is truncated: tensor blk.1.pi2_bundles needs bytes up to {len(data)} but the file has " \
           f"{last.data_offset + 100} bytes" in msgs["cut_in_data"]
    assert f"is truncated: tensor blk.1.pi2_bundles needs bytes up to {len(data)} but the file has {len(data) - 1} bytes" \
        in msgs["cut_one_byte"]


def test_corrupted_headers_never_crash(valid: tuple[factory.Sidecar, Path], tmp_path: Path) -> None:
    _, path = valid
    data = path.read_bytes()
    header_len = GGUFReader(path).tensors[0].data_offset
    rng = np.random.default_rng(7)
    paths = []
    for i in range(60):
        b = bytearray(data[:header_len])
        for pos in rng.integers(4, header_len, int(rng.integers(1, 4))):
            b[pos] = int(rng.integers(0, 256))
        p = tmp_path / f"fuzz{i}.pi2.gguf"
        p.write_bytes(bytes(b) + data[header_len:])
        paths.append(p)
    msgs = _validate_in_child(paths)
    for p, m in zip(paths, msgs):
        assert m == "OK" or m.startswith(f"sidecar {p}: "), m
    assert sum(m != "OK" for m in msgs) >= 10  # most byte flips in a header break something


def test_model_file_is_not_a_sidecar(tmp_path: Path) -> None:
    sc = factory.build()
    sc.arch = "llama"
    msg = _refused(factory.write(sc, tmp_path / "model.gguf"))
    assert "is not a pi2 sidecar: general.architecture is 'llama', not 'pi2'" in msg


@pytest.mark.parametrize("version", [1, 2, 3, 5])
def test_other_format_versions(tmp_path: Path, version: int) -> None:
    # versions 1 (one neuron per bundle), 2 (no pi2.activation_threshold) and 3 (no MoE keys) are refused like any
    # other: convert again
    sc = factory.build()
    sc.set("pi2.format_version", version)
    msg = _refused(factory.write(sc, tmp_path / "v.pi2.gguf"))
    assert f"has format version {version} (pi2.format_version), but this reader reads only version 4; convert the model again" in msg
    with pytest.raises(SidecarError, match=f"has format version {version}; this pi2-gguf reads version 4"):
        read_sidecar(tmp_path / "v.pi2.gguf")


@pytest.mark.parametrize("key", list(sf.KEYS))
def test_missing_key(tmp_path: Path, key: str) -> None:
    method = sf.METHOD_KEYS.get(key, "cats")  # a key only one method's sidecars hold: such a sidecar
    sc = factory.build(method=method)
    del sc.kv[key]
    msg = _refused(factory.write(sc, tmp_path / "k.pi2.gguf"))
    doc_type = {"u32[]": "u32[n_layer]", "f32[]": "f32[n_layer]", "u64[]": "u64[3 * n_layer]"}.get(sf.KEYS[key].value,
                                                                                                    sf.KEYS[key].value)
    needs = f": method {method} needs it" if key in sf.METHOD_KEYS else ""
    assert msg.endswith(f"key {key} ({doc_type}) is missing{needs}")


def test_product_sidecar_and_its_thresholds(tmp_path: Path) -> None:
    """A product sidecar carries pi2.sparsity.product_thresholds; both readers take it, and refuse a
    product sidecar without it, naming the key and the method (a cats sidecar has none: `valid`)."""
    from pi2_gguf.sidecar import reader as sidecar_py

    sc = factory.build(method="product")
    path = factory.write(sc, tmp_path / "p.pi2.gguf")
    validate_sidecar_c(path)
    assert sidecar_py.read(path).kv["pi2.sparsity.product_thresholds"] == [0.125, 0.125]
    del sc.kv["pi2.sparsity.product_thresholds"]
    bad = factory.write(sc, tmp_path / "p-bad.pi2.gguf")
    with pytest.raises(SidecarError, match=r"lacks key pi2\.sparsity\.product_thresholds \(method product needs it\)"):
        sidecar_py.read(bad)
    _refused(bad)  # message checked in test_missing_key
    assert "pi2.sparsity.product_thresholds" not in sidecar_py.read(factory.write(factory.build(), tmp_path / "c.pi2.gguf")).kv


@pytest.mark.parametrize(("key", "value", "vtype", "sub", "expected"), [
    ("pi2.format_version", 1, GGUFValueType.INT32, None, "key pi2.format_version is i32, expected u32"),
    ("pi2.n_embd", 64, GGUFValueType.UINT64, None, "key pi2.n_embd is u64, expected u32"),
    ("pi2.calib.date", [1, 2], GGUFValueType.ARRAY, GGUFValueType.UINT32,
     "key pi2.calib.date is an array of u32, expected string"),
    # what GGUFWriter.add_array makes of a list of Python ints
    ("pi2.n_ff", [96, 128], GGUFValueType.ARRAY, GGUFValueType.INT32,
     "key pi2.n_ff is an array of i32, expected u32[n_layer]"),
    ("pi2.sparsity.thresholds", 0.5, GGUFValueType.FLOAT32, None,
     "key pi2.sparsity.thresholds is a single f32, expected f32[n_layer]"),
])
def test_wrong_key_type(tmp_path: Path, key: str, value, vtype, sub, expected: str) -> None:
    sc = factory.build()
    sc.set_raw(key, value, vtype, sub)
    assert _refused(factory.write(sc, tmp_path / "t.pi2.gguf")).endswith(expected)


@pytest.mark.parametrize(("key", "length", "expected"), [
    ("pi2.n_ff", 1, "key pi2.n_ff has 1 elements, expected u32[n_layer] = 2 (pi2.n_layer is 2)"),
    ("pi2.predictor.cutoff", 3, "key pi2.predictor.cutoff has 3 elements, expected f32[n_layer] = 2"),
    ("pi2.source.tensor_fingerprints", 2,
     "key pi2.source.tensor_fingerprints has 2 elements, expected u64[3 * n_layer] = 6"),
])
def test_per_layer_array_of_wrong_length(tmp_path: Path, key: str, length: int, expected: str) -> None:
    sc = factory.build()
    v = sc.get(key)
    sc.set(key, (v * 2)[:length])
    assert expected in _refused(factory.write(sc, tmp_path / "len.pi2.gguf"))


@pytest.mark.parametrize(("count", "layer_experts", "expected"), [
    (1, [0, 1], None),  # dense layer 0, then one routed layer of one expert: the two sidecar layers
    (2, None, None),    # without the map: every model layer routes, here one layer of two experts
    (1, [2], None),     # one routed layer of one expert and its shared expert
    (1, [0, 3], "pi2.moe.layer_experts[1] is 3, not 0 (a dense FFN layer), pi2.moe.expert_count 1 (routed experts) or "
                "one more (and a shared expert)"),
    (1, [0, 0], "describes 2 sidecar layers and no routed layer, not its 2"),
    (1, [1, 1, 1], "describes 3 sidecar layers, not its 2"),
    (None, [0, 1], "has key pi2.moe.layer_experts but no pi2.moe.expert_count"),
    (3, None, "pi2.moe.expert_count is 3, which does not divide its 2 layers"),
])
def test_moe_layer_map(tmp_path: Path, count: int | None, layer_experts: list[int] | None, expected: str | None) -> None:
    """pi2.moe.layer_experts (FORMAT.md, "MoE sidecars"): dense FFN layers among routed ones, or refused by name in
    both readers."""
    sc = factory.build()
    if count is not None:
        sc.set_raw(sf.Key.MOE_EXPERT_COUNT, count, GGUFValueType.UINT32)
    if layer_experts is not None:
        sc.set_raw(sf.Key.MOE_LAYER_EXPERTS, layer_experts, GGUFValueType.ARRAY, GGUFValueType.UINT32)
    path = factory.write(sc, tmp_path / "moe.pi2.gguf")
    if expected is None:
        validate_sidecar_c(path)
        read_sidecar(path)
        return
    assert expected in _refused(path)
    with pytest.raises(SidecarError) as e:
        read_sidecar(path)
    assert expected in str(e.value)


@pytest.mark.parametrize("key,count,reads,expected", [
    (sf.Key.MOE_EXPERT_READS, 2, "bundles", None),
    (sf.Key.MOE_EXPERT_READS, 2, "model", None),  # every layer a routed expert read whole: their tensors are not read
    (sf.Key.MOE_EXPERT_READS, 2, "mmap", "key pi2.moe.expert_reads is not the string bundles or model"),
    (sf.Key.MOE_EXPERT_READS, None, "model", "has key pi2.moe.expert_reads but no pi2.moe.expert_count"),
    (sf.Key.DENSE_READS, None, "bundles", None),
    (sf.Key.DENSE_READS, None, "model", None),  # every layer read whole from the model file: no tensors read
    (sf.Key.DENSE_READS, None, "whole", "key pi2.dense_reads is not the string bundles or model"),
    (sf.Key.DENSE_READS, 2, "model", "has key pi2.dense_reads, which only a dense model's sidecar has, beside "
                                     "pi2.moe.expert_count"),
])
def test_reads_from_the_model_file(tmp_path: Path, key: str, count: int | None, reads: str, expected: str | None) -> None:
    """pi2.moe.expert_reads (FORMAT.md, "MoE sidecars") and pi2.dense_reads ("Dense FFN layers read whole from the
    model file"): bundles or model (layers read whole from the model file, which then have no tensors here), or
    refused by name in both readers."""
    sc = factory.build()
    if count is not None:
        sc.set_raw(sf.Key.MOE_EXPERT_COUNT, count, GGUFValueType.UINT32)
    sc.set_raw(key, reads, GGUFValueType.STRING)
    path = factory.write(sc, tmp_path / "reads.pi2.gguf")
    if expected is None:
        validate_sidecar_c(path)
        assert read_sidecar(path).whole_layers == (frozenset({0, 1}) if reads == "model" else frozenset())
        return
    assert expected in _refused(path)
    with pytest.raises(SidecarError) as e:
        read_sidecar(path)
    assert expected in str(e.value)


@pytest.mark.parametrize("value,gtype", [("q4_0", GGUFValueType.STRING), ("q8_0", GGUFValueType.STRING),
                                         ("q4_k", GGUFValueType.STRING), (2, GGUFValueType.UINT32)])
def test_predictor_w2_type(tmp_path: Path, value: str | int, gtype: GGUFValueType) -> None:
    """pi2.predictor.w2_type (FORMAT.md, "Optional keys"): q8_0 or q4_0, or refused by name in both readers."""
    sc = factory.build()
    sc.set_raw(sf.Key.PREDICTOR_W2_TYPE, value, gtype)
    path = factory.write(sc, tmp_path / "w2.pi2.gguf")
    if value in sf.PREDICTOR_W2_TYPES:
        validate_sidecar_c(path)
        assert read_sidecar(path).kv[sf.Key.PREDICTOR_W2_TYPE] == value
        return
    expected = "key pi2.predictor.w2_type is not the string q8_0 or q4_0"
    assert expected in _refused(path)
    with pytest.raises(SidecarError) as e:
        read_sidecar(path)
    assert expected in str(e.value)


def test_bundle_size_not_a_multiple_of_align(tmp_path: Path) -> None:
    sc = factory.build(bundle_size=[4096, 4000])
    msg = _refused(factory.write(sc, tmp_path / "b.pi2.gguf"))
    assert msg.endswith("pi2.bundle.size[1] is 4000, not a multiple of pi2.bundle.align = 4096")


@pytest.mark.parametrize("align", [512, 1024, 2048])
def test_smaller_bundle_alignments(tmp_path: Path, align: int) -> None:
    # n_embd 64 in F16: 384 bytes of rows, padded to the alignment; both readers take it
    path = factory.write(factory.build(bundle_align=align), tmp_path / "s.pi2.gguf")
    validate_sidecar_c(path)
    sc = read_sidecar(path)
    assert sc.bundles(1).shape == (128, align)
    assert [int(x) for x in sc.kv["pi2.bundle.size"]] == [align, align]
    bad = factory.build(bundle_align=align, bundle_size=[align, align + 256])
    msg = _refused(factory.write(bad, tmp_path / "b.pi2.gguf"))
    assert msg.endswith(f"pi2.bundle.size[1] is {align + 256}, not a multiple of pi2.bundle.align = {align}")
    with pytest.raises(SidecarError, match=f"not a multiple of pi2.bundle.align = {align}"):
        read_sidecar(factory.write(bad, tmp_path / "b2.pi2.gguf"))


def test_bundle_size_smaller_than_its_parts(tmp_path: Path) -> None:
    # n_embd 2048 in F16: gate, up and down rows of 4096 bytes each need a 12288-byte bundle
    sc = factory.build(n_embd=2048, n_ff=(16,), rank=(4,), bundle_size=[8192])
    msg = _refused(factory.write(sc, tmp_path / "b.pi2.gguf"))
    assert msg.endswith("pi2.bundle.size[0] is 8192, smaller than its 1 neurons of 12288 bytes "
                        "(gate f16 4096 + up f16 4096 + down f16 4096 for n_embd = 2048, to a multiple of 32)")


@pytest.mark.parametrize("align,neurons", [(512, 4), (512, 16), (4096, 3)])
def test_bundles_of_several_neurons(tmp_path: Path, align: int, neurons: int) -> None:
    # n_embd 64 in F16: 384 bytes a neuron; `neurons` of them in a bundle padded to the alignment, the last
    # bundle of a layer partly empty (96 and 128 neurons)
    sc = factory.build(bundle_align=align, bundle_neurons=neurons)
    path = factory.write(sc, tmp_path / "g.pi2.gguf")
    validate_sidecar_c(path)
    rd = read_sidecar(path)
    lay = rd.layout(1)
    assert (lay.stride, lay.neurons) == (384, neurons)
    assert lay.size == -(-neurons * 384 // align) * align
    assert rd.bundles(1).shape == (-(-128 // neurons), lay.size)
    # every slot's parts are its neuron's rows, where the format puts them
    gate, up, down = sc.weights[1]
    order = sc.tensors["blk.1.pi2_order"]
    slots = rd.slots(1)
    gs, us, ds = rd.bundle_slices(1)
    for j in (0, neurons - 1, neurons, 127):
        i = int(order[j])
        assert slots[j, gs].tobytes() == gate[i].tobytes()
        assert slots[j, us].tobytes() == up[i].tobytes()
        assert slots[j, ds].tobytes() == np.ascontiguousarray(down[:, i]).tobytes()


def test_bundles_padded_beyond_their_neurons(tmp_path: Path) -> None:
    # a bundle may be larger than its neurons need (the writer gives packed layers one size): 4 neurons of
    # 384 bytes in 2048 and 2560 bytes, the neurons where the stride puts them, padding after
    sc = factory.build(bundle_align=512, bundle_neurons=4, bundle_size=[2048, 2560])
    path = factory.write(sc, tmp_path / "p.pi2.gguf")
    validate_sidecar_c(path)
    rd = read_sidecar(path)
    assert [rd.layout(il).size for il in (0, 1)] == [2048, 2560]
    assert rd.layout(1).offset(5) == 2560 + 384
    gate, up, down = sc.weights[1]
    order = sc.tensors["blk.1.pi2_order"]
    slots, (gs, us, ds) = rd.slots(1), rd.bundle_slices(1)
    for j in (0, 3, 4, 127):
        i = int(order[j])
        assert slots[j, gs].tobytes() == gate[i].tobytes() and slots[j, us].tobytes() == up[i].tobytes()
        assert slots[j, ds].tobytes() == np.ascontiguousarray(down[:, i]).tobytes()


def test_bundle_neurons_out_of_range(tmp_path: Path) -> None:
    sc = factory.build()
    sc.set("pi2.bundle.neurons", [1, 17])
    assert _refused(factory.write(sc, tmp_path / "n.pi2.gguf")).endswith("pi2.bundle.neurons[1] is 17, expected 1..16")
    with pytest.raises(SidecarError, match="pi2.bundle.neurons is 17, not 1..16"):
        read_sidecar(factory.write(sc, tmp_path / "n2.pi2.gguf"))
    # 4 neurons of 384 bytes do not fit a 1024-byte bundle
    sc = factory.build(bundle_align=512, bundle_neurons=4, bundle_size=[2048, 1024])
    assert _refused(factory.write(sc, tmp_path / "s.pi2.gguf")).endswith(
        "pi2.bundle.size[1] is 1024, smaller than its 4 neurons of 384 bytes "
        "(gate f16 128 + up f16 128 + down f16 128 for n_embd = 64, to a multiple of 32)")


def test_bundle_part_type_must_divide_n_embd(tmp_path: Path) -> None:
    sc = factory.build()
    sc.set("pi2.bundle.down_type", [1, 12])  # Q4_K: blocks of 256 > n_embd 64
    msg = _refused(factory.write(sc, tmp_path / "q.pi2.gguf"))
    assert msg.endswith("pi2.bundle.down_type[1] is q4_K, whose blocks of 256 values do not divide n_embd = 64")
    sc.set("pi2.bundle.down_type", [1, 4])  # GGML_TYPE_Q4_2, removed from ggml
    assert _refused(factory.write(sc, tmp_path / "q.pi2.gguf")).endswith("pi2.bundle.down_type[1] is 4, not a ggml type")


def test_order_not_a_permutation(tmp_path: Path) -> None:
    sc = factory.build()
    order = sc.tensors["blk.1.pi2_order"].copy()
    order[5] = order[2]
    sc.tensors["blk.1.pi2_order"] = order
    msg = _refused(factory.write(sc, tmp_path / "o.pi2.gguf"))
    assert msg.endswith(f"blk.1.pi2_order is not a permutation of 0..n_ff-1: neuron {order[2]} is in slots 2 and 5")
    order[5] = 128
    msg = _refused(factory.write(sc, tmp_path / "o.pi2.gguf"))
    assert msg.endswith("blk.1.pi2_order is not a permutation of 0..n_ff-1: slot 5 holds 128 (n_ff = 128)")


@pytest.mark.parametrize("suffix", list(sf.TENSORS))
def test_missing_tensor(tmp_path: Path, suffix: str) -> None:
    sc = factory.build()
    del sc.tensors[sf.tensor_name(1, suffix)]
    assert _refused(factory.write(sc, tmp_path / "m.pi2.gguf")).endswith(f"tensor blk.1.{suffix} is missing")


def test_tensor_of_wrong_type_or_shape(tmp_path: Path) -> None:
    sc = factory.build()
    sc.tensors["blk.0.pi2_freq"] = sc.tensors["blk.0.pi2_freq"].astype(np.float16)
    assert _refused(factory.write(sc, tmp_path / "t.pi2.gguf")).endswith("tensor blk.0.pi2_freq is f16, expected f32")

    sc = factory.build()
    sc.tensors["blk.1.pi2_pred_w1"] = np.zeros((15, 64), np.float16)  # r is 16
    assert _refused(factory.write(sc, tmp_path / "s.pi2.gguf")).endswith(
        "tensor blk.1.pi2_pred_w1 has shape (64, 15, 1, 1), expected (n_embd, r) = (64, 16)")

    sc = factory.build()
    sc.tensors["blk.0.pi2_bundles"] = sc.tensors["blk.0.pi2_bundles"][:, :2048]
    assert _refused(factory.write(sc, tmp_path / "b.pi2.gguf")).endswith(
        "tensor blk.0.pi2_bundles has shape (2048, 96, 1, 1), expected (bundle size, n_bundles) = (4096, 96)")


def test_tensors_not_4096_aligned(tmp_path: Path) -> None:
    sc = factory.build()
    sc.alignment = 32
    msg = _refused(factory.write(sc, tmp_path / "a.pi2.gguf"))
    assert "starts at file offset" in msg and "not a multiple of 4096 (general.alignment is 32, must be 4096)" in msg


def test_inconsistent_fingerprint_and_enums(tmp_path: Path) -> None:
    sc = factory.build()
    sc.set("pi2.source.fingerprint", sc.get("pi2.source.fingerprint") ^ 1)
    assert "is inconsistent: pi2.source.fingerprint is 0x" in _refused(factory.write(sc, tmp_path / "f.pi2.gguf"))

    sc = factory.build()
    sc.set("pi2.activation", "swish")
    assert _refused(factory.write(sc, tmp_path / "a.pi2.gguf")).endswith(
        "pi2.activation is 'swish', not one of silu, gelu, gelu_erf, relu, drelu, fatrelu, swiglu_oai")

    for act, t in (("silu", 0.5), ("fatrelu", -1.0), ("fatrelu", float("nan"))):  # only FATReLU has a threshold, >= 0
        sc = factory.build()
        sc.set("pi2.activation", act)
        sc.set("pi2.activation_threshold", t)
        assert "pi2.activation_threshold is" in _refused(factory.write(sc, tmp_path / "t.pi2.gguf"))

    sc = factory.build()
    sc.set("pi2.hot_count", [96, 129])
    assert _refused(factory.write(sc, tmp_path / "h.pi2.gguf")).endswith("pi2.hot_count[1] is 129, more than n_ff = 128")

    for align in (256, 3072, 8192):
        sc = factory.build()
        sc.set("pi2.bundle.align", align)
        assert _refused(factory.write(sc, tmp_path / f"al{align}.pi2.gguf")).endswith(
            f"pi2.bundle.align is {align}, not a power of two from 512 to 4096")
