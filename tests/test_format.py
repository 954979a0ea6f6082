"""docs/FORMAT.md is the one specification of the sidecar: the Python declarations
(pi2_gguf/sidecar/format.py) and the C ones (ggml-backend/src/model/sidecar_format.h) must name exactly its
keys and tensors, with its types and shapes, and the same version, alignment and fingerprint constants."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pi2_gguf.sidecar import format as sf

ROOT = Path(__file__).resolve().parents[1]
FORMAT_MD = ROOT / "docs" / "FORMAT.md"
HEADER = ROOT / "ggml-backend" / "src" / "model" / "sidecar_format.h"


def _section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"FORMAT.md has no heading '{heading}'"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def _table_rows(section: str) -> list[list[str]]:
    """The body rows of the first table in a section."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:end]]
    assert len(rows) >= 3 and set(rows[1][0]) <= set("-: "), "not a markdown table"
    return rows[2:]


def _unquote(cell: str) -> str:
    assert cell.startswith("`") and cell.endswith("`"), cell
    return cell[1:-1]


@pytest.fixture(scope="module")
def spec_text() -> str:
    return FORMAT_MD.read_text()


@pytest.fixture(scope="module")
def doc_keys(spec_text: str) -> dict[str, str]:
    """key -> type exactly as FORMAT.md's key table writes it ("u32", "f32[n_layer]", ...)."""
    rows = _table_rows(_section(spec_text, "Keys"))
    keys = {_unquote(r[0]): r[1] for r in rows}
    assert len(keys) == len(rows), "duplicate key in FORMAT.md"
    return keys


@pytest.fixture(scope="module")
def doc_tensors(spec_text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """suffix -> (ggml type, shape) from FORMAT.md's tensor table."""
    out = {}
    for r in _table_rows(_section(spec_text, "Tensors (per layer N)")):
        name = _unquote(r[0])
        assert name.startswith("blk.N."), name
        shape = tuple(d.strip() for d in r[2].strip("()").split(","))
        out[name[len("blk.N."):]] = (r[1], shape)
    return out


@pytest.fixture(scope="module")
def header() -> dict[str, tuple[str, str]]:
    """#define NAME -> (value, trailing // comment) of the C header."""
    defs = {}
    for line in HEADER.read_text().splitlines():
        m = re.match(r"#define\s+(\w+)\s+(\"[^\"]*\"|\S+)\s*(?://\s*(.*))?$", line)
        if m:
            assert m.group(1) not in defs, f"{m.group(1)} defined twice"
            defs[m.group(1)] = (m.group(2), (m.group(3) or "").strip())
    return defs


def _kt_of(doc_type: str) -> str:
    # sidecar.format.KT writes per-layer arrays as "u32[]": drop the length expression
    return re.sub(r"\[.*\]$", "[]", doc_type)


def test_doc_tables_are_parsed(doc_keys: dict[str, str], doc_tensors: dict) -> None:
    # guards the parser: a reformatted table must not silently compare nothing
    assert len(doc_keys) == 36
    assert doc_keys["pi2.format_version"] == "u32"
    assert doc_keys["pi2.source.tensor_fingerprints"] == "u64[3 * n_layer]"
    assert doc_keys["pi2.bundle.size"] == "u32[n_layer]"
    assert len(doc_tensors) == 7
    assert doc_tensors["pi2_bundles"] == ("I8", ("bundle size", "n_bundles"))


# the optional keys the plugin reads (a setting convert measured the quality with; an MoE sidecar's expert count and
# layer map); the C reader knows no other
PLUGIN_OPTIONAL_KEYS = {"pi2.budget.output_rows", "pi2.budget.output_copy", "pi2.moe.expert_count",
                        "pi2.moe.layer_experts", "pi2.moe.expert_reads", "pi2.dense_reads", "pi2.predictor.w2_type"}


def _doc_optional_keys(spec_text: str) -> dict[str, str]:
    return {_unquote(r[0]): r[1] for r in _table_rows(_section(spec_text, "Optional keys"))}


def test_optional_keys_match_doc(spec_text: str, header: dict[str, tuple[str, str]]) -> None:
    """FORMAT.md's optional keys are sidecar.format.OPTIONAL_KEYS, none of them required; the C header declares
    only the one the plugin reads, with the type the table gives."""
    doc = _doc_optional_keys(spec_text)
    assert {k: v.value for k, v in sf.OPTIONAL_KEYS.items()} == doc
    assert not set(doc) & set(sf.KEYS)
    in_header = {v[0].strip('"'): v[1] for k, v in header.items() if k.startswith("PI2_KEY_") and v[0].strip('"') in doc}
    assert in_header == {k: doc[k] for k in PLUGIN_OPTIONAL_KEYS}


def test_python_keys_match_doc(doc_keys: dict[str, str]) -> None:
    assert list(sf.KEYS) == list(doc_keys)  # same keys, same order
    assert {k: v.value for k, v in sf.KEYS.items()} == {k: _kt_of(t) for k, t in doc_keys.items()}


def test_python_tensors_match_doc(doc_tensors: dict) -> None:
    assert sf.TENSORS == doc_tensors


def test_header_keys_match_doc(header: dict[str, tuple[str, str]], doc_keys: dict[str, str]) -> None:
    keys = {v[0].strip('"'): v[1] for k, v in header.items() if k.startswith("PI2_KEY_")}
    assert len(keys) == len([k for k in header if k.startswith("PI2_KEY_")]), "a key string is defined twice"
    # every key, and the type in its comment as the table writes it (the optional one the plugin reads aside)
    assert {k: t for k, t in keys.items() if k not in PLUGIN_OPTIONAL_KEYS} == doc_keys


def test_header_key_macro_names_follow_keys(header: dict[str, tuple[str, str]]) -> None:
    for name, (value, _) in header.items():
        if name.startswith("PI2_KEY_"):
            expected = "PI2_KEY_" + value.strip('"').removeprefix("pi2.").replace(".", "_").upper()
            assert name == expected


def test_header_tensors_match_doc(header: dict[str, tuple[str, str]], doc_tensors: dict) -> None:
    tensors = {}
    for name, (value, comment) in header.items():
        if name.startswith("PI2_TENSOR_"):
            m = re.fullmatch(r"(\w+) \((.*)\)", comment)
            assert m, f"{name}: comment '{comment}' is not 'TYPE (shape)'"
            tensors[value.strip('"')] = (m.group(1), tuple(d.strip() for d in m.group(2).split(",")))
    assert tensors == doc_tensors


def test_optional_tensor_matches_doc(spec_text: str, header: dict[str, tuple[str, str]]) -> None:
    """FORMAT.md's optional tensor (output.pi2_copy) is sidecar.format.OPTIONAL_TENSORS and the C header's
    PI2_OPTIONAL_TENSOR_ define: name, the types it may have, shape."""
    rows = _table_rows(_section(spec_text, "Optional tensor"))
    doc = {_unquote(r[0]): (tuple(t.strip() for t in re.split(r",| or ", r[1]) if t.strip()),
                            tuple(d.strip() for d in r[2].strip("()").split(","))) for r in rows}
    assert doc == sf.OPTIONAL_TENSORS == {sf.OUTPUT_COPY_TENSOR: (("Q3_K", "Q2_K", "Q4_0"), ("n_embd", "n_vocab"))}
    in_header = {}
    for name, (value, comment) in header.items():
        if name.startswith("PI2_OPTIONAL_TENSOR_"):
            m = re.fullmatch(r"([\w|]+) \((.*)\)", comment)
            assert m, f"{name}: comment '{comment}' is not 'TYPE|TYPE (shape)'"
            in_header[value.strip('"')] = (tuple(m.group(1).split("|")), tuple(d.strip() for d in m.group(2).split(",")))
    assert in_header == doc


def test_version_and_alignment(spec_text: str, header: dict[str, tuple[str, str]]) -> None:
    doc_version = int(re.search(r"^# The pi2 sidecar GGUF, format version (\d+)$", spec_text, re.M).group(1))
    doc_align = int(re.search(r"`general\.alignment` is (\d+)", spec_text).group(1))
    assert doc_version == sf.FORMAT_VERSION == int(header["PI2_FORMAT_VERSION"][0]) == 4
    stride = int(re.search(r"where stride is the\s+end of a neuron's three parts rounded up to (\d+) bytes", spec_text).group(1))
    assert stride == sf.NEURON_ALIGN == int(header["PI2_NEURON_ALIGN"][0]) == 32
    most = int(re.search(r"`pi2\.bundle\.neurons` \| u32\[n_layer\] \| neurons per bundle, 1 to (\d+)", spec_text).group(1))
    assert most == sf.MAX_BUNDLE_NEURONS == int(header["PI2_MAX_BUNDLE_NEURONS"][0]) == 16
    assert doc_align == sf.BUNDLE_ALIGN == int(header["PI2_BUNDLE_ALIGN"][0]) == 4096
    aligns = re.search(r"`pi2\.bundle\.align` \| u32 \| ([\d, or]+) \(the writer's default", spec_text).group(1)
    assert tuple(int(a) for a in re.findall(r"\d+", aligns)) == sf.BUNDLE_ALIGNS
    assert (sf.BUNDLE_ALIGNS[0], sf.BUNDLE_ALIGNS[-1]) == (int(header["PI2_BUNDLE_ALIGN_MIN"][0]), doc_align)
    assert all(b == 2 * a for a, b in zip(sf.BUNDLE_ALIGNS, sf.BUNDLE_ALIGNS[1:]))  # the C reader: powers of two
    assert header["PI2_ARCHITECTURE"][0] == f'"{sf.ARCHITECTURE}"'
    assert f"`general.architecture` is `{sf.ARCHITECTURE}`" in spec_text


def test_fingerprint_constants(spec_text: str, header: dict[str, tuple[str, str]]) -> None:
    m = re.search(r"offset basis (0x[0-9a-fA-F]+), prime (0x[0-9a-fA-F]+)", spec_text)
    basis, prime = int(m.group(1), 16), int(m.group(2), 16)
    assert basis == sf.FNV_OFFSET == int(header["PI2_FP_OFFSET_BASIS"][0].rstrip("ULul"), 16)
    assert prime == sf.FNV_PRIME == int(header["PI2_FP_PRIME"][0].rstrip("ULul"), 16)
    samples = int(re.search(r"then (\d+) samples", spec_text).group(1))
    sample_bytes = int(re.search(r"s = min\((\d+),", spec_text).group(1))
    assert samples == sf.FP_SAMPLES == int(header["PI2_FP_SAMPLES"][0]) == 16
    assert sample_bytes == sf.FP_SAMPLE_BYTES == int(header["PI2_FP_SAMPLE_BYTES"][0]) == 256


def test_many_fingerprints_at_once_equal_one_at_a_time() -> None:
    """tensor_fingerprints (the hashes of equally long inputs advanced together) gives tensor_fingerprint's value for
    each: tensors above and below the 256-byte sample, equal and different sizes, experts' views of one stack."""
    import numpy as np

    rng = np.random.default_rng(0)
    stack = rng.integers(0, 256, size=(4, 96, 144), dtype=np.uint8)
    ts = [(12, 256, 96, stack[e]) for e in range(4)]
    ts += [(8, 32, 3, rng.integers(0, 256, size=(3, 34), dtype=np.uint8)), (0, 5, 1, np.zeros((1, 20), np.uint8)),
           (1, 64, 2, rng.integers(0, 256, size=(2, 128), dtype=np.uint8))]
    one = [sf.tensor_fingerprint(*t) for t in ts]
    assert sf.tensor_fingerprints(ts) == one and len(set(one)) == len(one)
    assert sf.tensor_fingerprints([]) == []


def test_activation_and_method_values(spec_text: str, header: dict[str, tuple[str, str]]) -> None:
    row = re.search(r"^\| `pi2\.activation` \| string \| (.*) \|$", spec_text, re.M).group(1)
    doc_acts = re.findall(r"`(\w+)`", row)
    assert tuple(doc_acts) == sf.ACTIVATIONS
    assert [v[0].strip('"') for k, v in header.items() if k.startswith("PI2_ACTIVATION_")] == doc_acts
    row = re.search(r"^\| `pi2\.sparsity\.method` \| string \| (.*) \|$", spec_text, re.M).group(1)
    doc_methods = re.findall(r"`(\w+)` \(", row)
    assert tuple(doc_methods) == sf.SPARSITY_METHODS
    assert [v[0].strip('"') for k, v in header.items() if k.startswith("PI2_SPARSITY_")] == doc_methods


def test_method_only_keys_match_doc(spec_text: str, doc_keys: dict[str, str]) -> None:
    """Keys FORMAT.md marks "only in `M` sidecars" are sidecar.format.METHOD_KEYS (the C reader's `only`
    field is tested by test_sidecar_reader.test_missing_key)."""
    only = dict(re.findall(r"^\| `([\w.]+)` \| [^|]+ \| only in `(\w+)` sidecars", spec_text, re.M))
    assert only == sf.METHOD_KEYS == {"pi2.sparsity.product_thresholds": "product"}
    assert set(only) <= set(doc_keys)
    assert set(sf.keys_of("cats")) == set(sf.KEYS) - set(only) and set(sf.keys_of("product")) == set(sf.KEYS)


def test_key_constants_are_the_keys() -> None:
    """sidecar.format.Key names every key of KEYS and OPTIONAL_KEYS once, each as the C header's PI2_KEY_* macro
    without its prefix."""
    consts = {name: value for name, value in vars(sf.Key).items() if not name.startswith("_")}
    assert sorted(consts.values()) == sorted({**sf.KEYS, **sf.OPTIONAL_KEYS})
    assert set(sf.METHOD_KEYS) <= set(consts.values())
    for name, value in consts.items():
        assert name == value.removeprefix("pi2.").replace(".", "_").upper()
