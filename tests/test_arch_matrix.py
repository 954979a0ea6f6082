"""The architecture matrix: for each of 17 families, a tiny random checkpoint with the family's real config layout,
converted by llama.cpp's own converter (tests/tiny_families.py), run through PI2 against stock llama.cpp.

- dense: with PI2 holding every FFN layer (PI2_LAYERS=all) the logits equal stock llama.cpp's, in f32, f16 and
  q8_0; with the default placement they are stock's bit for bit;
- `convert` writes a sidecar, or refuses with a message naming the layer and what it does not support;
- with the sidecar, in RAM: `dense` equals stock, ReLU-family `oracle` gives dense's greedy tokens, `predicted`
  runs; under a memory budget each mode gives the in-RAM run's tokens, reading bundles from flash;
- a budget for a model convert cannot make a sidecar for is refused at load, naming the reason.

docs/ARCHITECTURES.md's table is written from ROWS below; test_table_matches_the_matrix fails when they differ."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

for _module in ("torch", "transformers", "sentencepiece", "safetensors"):  # the `import` extra
    pytest.importorskip(_module)

import pi2_gguf  # noqa: E402
from pi2_gguf.converter.convert import convert  # noqa: E402
from pi2_gguf.errors import MemoryBudgetError, ModelFileError  # noqa: E402
from pi2_gguf.runtime.generate import Greedy  # noqa: E402
from pi2_gguf.runtime.isolated import greedy_in_subprocess  # noqa: E402
from pi2_gguf.sidecar import format as fmt  # noqa: E402
from pi2_gguf.sidecar.format import Key, moe_layer_first  # noqa: E402
from pi2_gguf.sidecar.inspect import summary  # noqa: E402
from pi2_gguf.sidecar.reader import read as read_sidecar  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
import tiny_families as tf  # noqa: E402
from gguf_copy import copy_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the Roman Empire covers"
N_TOKENS = 8
# under a budget: a neuron cache far below the FFN's size, so every mode reads bundles from the sidecar; prompt
# tokens one at a time in both runs (sparse_batch 64): in RAM a prompt batch runs dense, under a budget through
# the flash batch path, and for a SiLU model's approximate sparse modes those drop different neurons
FLASH = {"cache_max": "64KiB", "sparse_batch": 64}
RAM = {"layers": "all", "sparse_batch": 64}


@dataclass(frozen=True)
class Row:
    computes: str         # what PI2 computes with every layer held (the ARCHITECTURES.md column)
    pi2_ops: str          # which of the FFN's gate/up/down products and GLU PI2 ran (counters), space-separated
    sidecar: str          # "yes", or the words convert's refusal says
    sparse: str           # "exact" (ReLU family), "approximate" (SiLU/GELU), "no"
    flash: str            # "yes", or "no"


_NO = "no (no sidecar)"
ROWS: dict[str, Row] = {
    "llama": Row("dense FFN: products and SwiGLU", "gate up down glu", "yes", "approximate", "yes"),
    "mistral": Row("dense FFN: products and SwiGLU", "gate up down glu", "yes", "approximate", "yes"),
    "qwen2": Row("dense FFN: products and SwiGLU", "gate up down glu", "yes", "approximate", "yes"),
    "qwen3": Row("dense FFN: products and SwiGLU", "gate up down glu", "yes", "approximate", "yes"),
    "gemma2": Row("dense FFN: products and GeGLU", "gate up down glu", "yes", "approximate", "yes"),
    "gemma3": Row("dense FFN: products and GeGLU", "gate up down glu", "yes", "approximate", "yes"),
    "phi3": Row("fused gate+up product (its two halves), the split SwiGLU and down", "up down glu", "yes",
                "approximate", "yes"),
    "starcoder2": Row("up and down products; biases and GELU in ggml-cpu", "up down", "has no gate", "no", _NO),
    "mixtral": Row("routed experts: products and SwiGLU; routing in ggml-cpu", "gate up down glu", "yes",
                   "approximate", "yes"),
    "qwen3moe": Row("routed experts: products and SwiGLU; routing in ggml-cpu", "gate up down glu", "yes",
                    "approximate", "yes"),
    "qwen2moe": Row("routed and shared experts: products and SwiGLU; routing and the shared expert's sigmoid gate in "
                    "ggml-cpu", "gate up down glu", "yes", "approximate", "yes"),
    "olmoe": Row("routed experts: products and SwiGLU; routing in ggml-cpu", "gate up down glu", "yes",
                 "approximate", "yes"),
    "granitemoe": Row("routed experts: products and SwiGLU; routing in ggml-cpu", "gate up down glu", "yes",
                      "approximate", "yes"),
    "gpt_oss": Row("routed experts: products, biases and SwiGLU-OAI; routing in ggml-cpu", "gate up down glu", "yes",
                   "approximate", "yes"),
    "deepseek2": Row("dense first layer, routed and shared experts: products and SwiGLU; routing in ggml-cpu",
                     "gate up down glu", "yes", "approximate", "yes"),
    "glm4moe": Row("dense first layer, routed and shared experts: products and SwiGLU; routing in ggml-cpu",
                   "gate up down glu", "yes", "approximate", "yes"),
    "smallthinker": Row("routed experts: products and ReGLU; routing in ggml-cpu", "gate up down glu", "yes", "exact",
                        "yes"),
}


@pytest.fixture(scope="module")
def built(tiny_family_ggufs: dict[tuple[str, str], Path]) -> dict[tuple[str, str], Path]:
    """Every family's GGUF in every type (conftest.py converts them once for the session)."""
    return tiny_family_ggufs


def _relative(a: list[float], b: list[float]) -> float:
    x, y = np.array(a), np.array(b)
    return float(np.abs(x - y).max() / np.abs(y).max())


def test_rows_cover_the_families() -> None:
    assert list(ROWS) == list(tf.FAMILIES)


@pytest.mark.parametrize("outtype", tf.OUTTYPES)
@pytest.mark.parametrize("name", list(tf.FAMILIES))
def test_dense_equals_stock(built: dict[tuple[str, str], Path], name: str, outtype: str) -> None:
    model = built[(name, outtype)]
    stock = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    held = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0
    assert held.tokens == stock.tokens
    assert _relative(held.logits_first, stock.logits_first) <= 1e-4
    placed = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False)[0]
    assert placed.tokens == stock.tokens and placed.logits_first == stock.logits_first  # bit for bit


def _decode_step_counters(model: Path) -> pi2_gguf.Counters:
    """PI2's counters of one decode step after the prompt, without a sidecar and with every layer held (the tests'
    PI2_LAYERS=all, conftest.py)."""
    llm = pi2_gguf.Llama(str(model), sidecar=False, n_ctx=128, n_threads=2, verbose=False)
    try:
        assert llm.layers_left() == []
        llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
        pi2_gguf.reset_counters()
        llm.eval([5])
        return pi2_gguf.read_counters()
    finally:
        llm.close()


@pytest.mark.parametrize("name", list(tf.FAMILIES))
def test_what_pi2_computes(built: dict[tuple[str, str], Path], name: str) -> None:
    """The products (and the GLU) PI2 runs for one decode step with every layer held, as ROWS says."""
    c = _decode_step_counters(built[(name, "f32")])
    ran = [m for m, n in zip(("gate", "up", "down"), c.matmul_calls.sum(axis=0)) if n > 0]
    ran += ["glu"] if c.glu_calls.sum() > 0 else []
    assert " ".join(ran) == ROWS[name].pi2_ops


@pytest.fixture(scope="module")
def sidecars(built: dict[tuple[str, str], Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | ModelFileError]:
    """convert's sidecar for each family's f32 model (its defaults but routed experts in neuron bundles, the path
    these tests take; the default's whole reads: test_moe_sidecar_holds_no_second_copy), or its refusal; in a
    directory of their own, so no run takes one as its model's default sidecar."""
    d = tmp_path_factory.mktemp("arch_matrix_sidecars")
    out: dict[str, Path | ModelFileError] = {}
    for name in tf.FAMILIES:
        model = built[(name, "f32")]
        try:
            out[name] = convert(model, d / f"{name}.pi2.gguf", train_tokens=1024, heldout_tokens=256,
                                progress=False, perplexity_budget=None, expert_reads="bundles").path
        except ModelFileError as e:
            out[name] = e
    return out


@pytest.mark.parametrize("name", list(tf.FAMILIES))
def test_convert_makes_a_sidecar_or_says_why_not(sidecars: dict[str, Path | ModelFileError], name: str) -> None:
    got, want = sidecars[name], ROWS[name].sidecar
    if want == "yes":
        assert isinstance(got, Path) and got.stat().st_size > 0
    else:
        assert isinstance(got, ModelFileError) and want in str(got)
        assert re.search(r"blk\.\d+", str(got)), got  # the layer is named


@pytest.mark.parametrize("name", [n for n in tf.FAMILIES if ROWS[n].sidecar == "yes"])
def test_modes_with_the_sidecar_in_ram_and_under_a_budget(built: dict[tuple[str, str], Path],
                                                          sidecars: dict[str, Path | ModelFileError], name: str) -> None:
    model, sidecar = built[(name, "f32")], sidecars[name]
    assert isinstance(sidecar, Path)
    stock = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    ram: dict[str, list[int]] = {}
    for mode in ("dense", "oracle", "predicted"):
        run = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                   settings=RAM)[0]
        assert run.pi2_matmuls > 0 and len(run.tokens) == N_TOKENS, mode
        ram[mode] = run.tokens
        if mode == "dense":
            # stock's tokens, and exactly the logits of PI2 without a sidecar on the same settings: prompt tokens in
            # PI2's kernels, whose sums differ from ggml-cpu's batched ones by rounding (27-layer deepseek2: 1.6e-3)
            alone = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, settings=RAM)[0]
            assert run.tokens == stock.tokens and run.logits_first == alone.logits_first
        flash = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                     memory_budget=2 << 30, settings=FLASH)[0]
        assert flash.tokens == run.tokens, mode
        assert flash.io["bundle_bytes"] > 0 and flash.io["misses"] > 0, (mode, flash.io)
    if ROWS[name].sparse == "exact":  # ReLU family: the oracle's neurons are exactly the active ones
        assert ram["oracle"] == ram["dense"]


def _shared_expert_layers(model: Path) -> list[int]:
    return sorted(int(t.name.split(".")[1]) for t in GGUFReader(model, "r").tensors if t.name.endswith("ffn_gate_shexp.weight"))


@pytest.mark.parametrize("name", ["qwen2moe", "deepseek2", "glm4moe"])
def test_shared_experts_in_pi2(built: dict[tuple[str, str], Path], sidecars: dict[str, Path | ModelFileError],
                               name: str) -> None:
    """A layer's shared expert is PI2's: in RAM its three products run beside the routed experts' (each layer's
    counters: the experts' product once and the shared expert's once), and under a budget it is one more sidecar layer
    whose bundles the cache holds or reads."""
    model, sidecar = built[(name, "f32")], sidecars[name]
    shared = _shared_expert_layers(model)
    assert shared
    c = _decode_step_counters(model)
    assert all(c.matmul_calls[il].tolist() == [2, 2, 2] for il in shared), c.matmul_calls[: max(shared) + 1]
    assert isinstance(sidecar, Path)
    kv = read_sidecar(sidecar).kv
    n_expert = kv[Key.MOE_EXPERT_COUNT]
    first = moe_layer_first(kv[Key.MOE_LAYER_EXPERTS], n_expert, len(kv[Key.N_FF]))
    assert [il for il in range(len(first) - 1) if first[il + 1] - first[il] == n_expert + 1] == shared
    text = summary(read_sidecar(sidecar))  # inspect says which sidecar layer each shared expert and dense layer is
    assert text.count("; shared expert: sidecar layer") == len(shared)
    assert text.count("dense FFN (sidecar layer") == sum(1 for c in kv[Key.MOE_LAYER_EXPERTS] if c == 0)
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", memory_budget=2 << 30, settings=FLASH, n_ctx=128,
                         n_threads=2, verbose=False)
    try:
        pi2_gguf.reset_counters()
        llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
        c = pi2_gguf.read_counters()
    finally:
        llm.close()
    found = c.hot_hits + c.cold_hits + c.misses
    assert all(found[first[il] + n_expert] > 0 for il in shared), found


@pytest.mark.parametrize("name", ["qwen2moe", "granitemoe", "deepseek2", "glm4moe"])
def test_relu_stated_moe_oracle_equals_dense(built: dict[tuple[str, str], Path], tmp_path: Path, name: str) -> None:
    """An MoE layout that states a ReLU-family activation (<arch>.ffn_activation = relu): PI2 computes it in every
    routed expert, shared expert and dense layer, the sidecar's sparsity is exact, and oracle gives dense's tokens;
    under a budget each mode gives its in-RAM tokens."""
    arch = tf.FAMILIES[name].arch
    model = copy_gguf(built[(name, "f32")], tmp_path / f"{name}-relu.gguf", set_kv={f"{arch}.ffn_activation": "relu"})
    sidecar = convert(model, tmp_path / f"{name}-relu.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                      perplexity_budget=None).path
    assert read_sidecar(sidecar).kv[Key.SPARSITY_METHOD] == "relu"
    ram: dict[str, Greedy] = {}
    for mode in ("dense", "oracle"):
        ram[mode] = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                         settings=RAM)[0]
        flash = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                     memory_budget=2 << 30, settings=FLASH)[0]
        assert flash.tokens == ram[mode].tokens, mode
    assert ram["oracle"].tokens == ram["dense"].tokens
    assert _relative(ram["oracle"].logits_first, ram["dense"].logits_first) <= 1e-4


def _fuse_gate_up_exps(src: Path, dst: Path) -> Path:
    """src (an f32 MoE GGUF) with each layer's ffn_gate_exps and ffn_up_exps as one ffn_gate_up_exps, each expert's gate
    rows then its up rows, as llama.cpp's converter writes them with --fuse-gate-up-exps (its pinned gguf-py lists
    that tensor for other architectures only; llama.cpp loads it for deepseek2)."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[1] if f.types[0] == GGUFValueType.ARRAY else None)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            continue
        if t.name.endswith("ffn_gate_exps.weight"):
            up = tensors[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
            w.add_tensor(t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([t.data, up.data], axis=1))
            continue
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if t.tensor_type > 1 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_fused_expert_gate_up(built: dict[tuple[str, str], Path], sidecars: dict[str, Path | ModelFileError],
                              tmp_path: Path) -> None:
    """deepseek2 with ffn_gate_up_exps (--fuse-gate-up-exps): llama.cpp computes the function of the split model; PI2
    takes the fused product and its two views as the experts' gate and up, and the split model's sidecar describes
    the fused one (each half is fingerprinted as the tensor it replaces): dense equals stock, and each mode gives
    the tokens of the split model's run, in RAM and under a budget."""
    split = built[("deepseek2", "f32")]
    fused = _fuse_gate_up_exps(split, tmp_path / "deepseek2-fused.gguf")
    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in GGUFReader(fused).tensors)
    stock = greedy_in_subprocess(split, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    stock_fused = greedy_in_subprocess(fused, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    assert stock_fused.tokens == stock.tokens and _relative(stock_fused.logits_first, stock.logits_first) <= 1e-5
    held = greedy_in_subprocess(fused, [PROMPT], N_TOKENS, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0 and held.tokens == stock.tokens
    assert _relative(held.logits_first, stock_fused.logits_first) <= 1e-4
    sidecar = sidecars["deepseek2"]
    assert isinstance(sidecar, Path)
    for mode in ("dense", "predicted"):
        want = greedy_in_subprocess(split, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                    settings=RAM)[0]
        ram = greedy_in_subprocess(fused, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                   settings=RAM)[0]
        flash = greedy_in_subprocess(fused, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                     memory_budget=2 << 30, settings=FLASH)[0]
        assert ram.tokens == want.tokens and flash.tokens == want.tokens, mode
        assert flash.io["expert_misses"] > 0, flash.io



def test_gpt_oss_in_mxfp4(built: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """gpt-oss as published: experts in MXFP4 (llama.cpp's quantizer, MXFP4_MOE), biases f32. PI2 holding every layer
    gives stock's tokens and logits; with a sidecar the experts run from flash under a budget with the in-RAM run's
    tokens in the modes that read the sidecar's bundles in RAM too (dense in RAM computes the model's own down rows,
    which bundles hold re-quantized as columns: docs/CONVERT.md)."""
    import ctypes

    import llama_cpp

    model = tmp_path / "gpt_oss.mxfp4.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(built[("gpt_oss", "f32")]).encode(), str(model).encode(),
                                          ctypes.byref(params)) == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(model).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_gate_exps.bias"] == "F32"
    stock = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=False, repack=False)[0]
    held = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0 and held.tokens == stock.tokens
    assert _relative(held.logits_first, stock.logits_first) <= 1e-4
    sidecar = convert(model, tmp_path / "gpt_oss.mxfp4.pi2.gguf", train_tokens=1024, heldout_tokens=256,
                      progress=False, perplexity_budget=None, expert_reads="bundles").path
    for mode in ("oracle", "predicted"):
        ram = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode=mode,
                                   settings=RAM)[0]
        flash = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                     memory_budget=2 << 30, settings=FLASH)[0]
        assert flash.tokens == ram.tokens, mode
        assert flash.io["expert_misses"] > 0 and flash.io["bundle_bytes"] > 0, flash.io

_MOE = [n for n, r in ROWS.items() if r.sidecar == "yes" and ("routed" in r.computes)]


@pytest.mark.parametrize("name", _MOE)
def test_moe_sidecar_holds_no_second_copy(built: dict[tuple[str, str], Path], sidecars: dict[str, Path | ModelFileError],
                                          tmp_path: Path, name: str) -> None:
    """convert's default for experts that are not ReLU-family (--expert-reads auto; every family here but
    SmallThinker, whose ReGLU keeps bundles and is asked for model): routed experts are read whole from the model
    file under a budget, and the sidecar holds no
    bundles, predictors or rankings of them (where every FFN is a routed expert: at most 15% of the model file, these
    well under 1%); under a budget every mode gives the tokens of the in-RAM dense run, whose experts run dense. The
    sidecar converted with --expert-reads bundles holds them."""
    model, bundled = built[(name, "f32")], sidecars[name]
    assert isinstance(bundled, Path) and read_sidecar(bundled).kv[Key.MOE_EXPERT_READS] == "bundles"
    res = convert(model, tmp_path / f"{name}.whole.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                  perplexity_budget=None)
    if res.meta.activation in fmt.RELU_FAMILY:  # SmallThinker's ReGLU: auto keeps bundles, read only where they fire
        assert res.meta.expert_reads == "bundles" and any("--expert-reads auto" in n for n in res.notes), res.notes
        res = convert(model, tmp_path / f"{name}.whole.pi2.gguf", train_tokens=1024, heldout_tokens=256,
                      progress=False, perplexity_budget=None, expert_reads="model")
    else:
        assert any("--expert-reads auto" in n for n in res.notes), res.notes
    sidecar = res.path
    sc = read_sidecar(sidecar)
    assert sc.kv[Key.MOE_EXPERT_READS] == "model"
    assert not any(t.endswith("pi2_bundles") and int(t.split(".")[1]) in sc.whole_layers for t in sc.tensors)
    n_expert = sc.kv[Key.MOE_EXPERT_COUNT]
    counts = sc.kv.get(Key.MOE_LAYER_EXPERTS) or [n_expert] * (sc.n_layer // n_expert)
    assert len(sc.whole_layers) == n_expert * sum(1 for c in counts if c)  # every routed expert, no shared one
    assert "read whole from the model file" in summary(sc)
    if not _shared_expert_layers(model) and name not in ("deepseek2", "glm4moe"):
        assert sidecar.stat().st_size <= 0.15 * model.stat().st_size, (sidecar.stat().st_size, model.stat().st_size)
        assert "sparsity       none: every FFN layer is read whole" in summary(sc)  # no target or predictor to show
    else:
        assert "sparsity       product, target 0.50" in summary(sc)  # the dense layers' and shared experts' plan
    ram = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode="dense",
                               settings=RAM)[0]
    for mode in ("dense", "predicted"):
        flash = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode=mode,
                                     memory_budget=2 << 30, settings=FLASH)[0]
        assert flash.io["expert_bytes"] > 0 and flash.io["expert_misses"] > 0, flash.io
        if not _shared_expert_layers(model) and name not in ("deepseek2", "glm4moe"):  # every FFN read whole: exact
            assert flash.tokens == ram.tokens, mode


@pytest.mark.parametrize("name", _MOE)
def test_routed_experts_read_whole_from_the_model_file(built: dict[tuple[str, str], Path],
                                                       sidecars: dict[str, Path | ModelFileError], name: str) -> None:
    """PI2_EXPERT_READS=model: under a budget each routed expert is read whole from the model file into the expert
    cache and computed there as in RAM, so dense mode gives the in-RAM tokens, and where every FFN is a routed expert
    (no dense first layer, no shared expert, which still come from the sidecar's bundles) the in-RAM logits exactly;
    prompts one token at a time and as batches alike, and with reads split into 4 KiB requests into a cache of
    several experts (each expert's spans then arrive in many parts)."""
    model, sidecar = built[(name, "f32")], sidecars[name]
    assert isinstance(sidecar, Path)
    ram = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, repack=False, sidecar=sidecar, mode="dense",
                               settings=RAM)[0]
    routed_only = not _shared_expert_layers(model) and name not in ("deepseek2", "glm4moe")
    small_reads = {"io_max_bytes": "4KiB", "cache_max": "512KiB"}
    for sparse_batch, more in ((64, {}), (4, {}), (4, small_reads)):
        flash = greedy_in_subprocess(model, [PROMPT], N_TOKENS, pi2=True, sidecar=sidecar, mode="dense",
                                     memory_budget=2 << 30, settings={**FLASH, "sparse_batch": sparse_batch,
                                                                      "expert_reads": "model", **more})[0]
        assert flash.tokens == ram.tokens, (sparse_batch, more)
        assert flash.io["expert_bytes"] > 0 and flash.io["expert_misses"] > 0, flash.io
        if routed_only:
            assert flash.logits_first == ram.logits_first and flash.io["hot_hits"] == 0, flash.io
        else:  # the sparse engine's sums of the shared experts' and dense layers' bundles round apart (27 layers: 1e-3)
            assert _relative(flash.logits_first, ram.logits_first) <= 5e-3


@pytest.mark.parametrize("name", [n for n in tf.FAMILIES if ROWS[n].sidecar != "yes"])
def test_budget_without_a_possible_sidecar_says_why(built: dict[tuple[str, str], Path], name: str) -> None:
    with pytest.raises(MemoryBudgetError, match=re.escape(ROWS[name].sidecar)):
        pi2_gguf.Llama(str(built[(name, "f32")]), memory_budget="1GB", n_ctx=128, verbose=False)


def _table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "ARCHITECTURES.md").read_text()
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] not in ("Family", "") and not cells[0].startswith("-"):
            rows[cells[0]] = cells[1:]
    return rows


def test_table_matches_the_matrix() -> None:
    """ARCHITECTURES.md's table: family, GGUF architecture, what PI2 computes, sidecar, sparse decode, flash."""
    table = _table()
    assert list(table) == list(ROWS)
    for name, row in ROWS.items():
        arch, computes, sidecar, sparse, flash = table[name]
        assert arch == f"`{tf.FAMILIES[name].arch}`", name
        assert computes == row.computes, name
        assert sidecar == ("yes" if row.sidecar == "yes" else f"no: {row.sidecar}"), name
        assert sparse == row.sparse, name
        assert flash == row.flash, name
