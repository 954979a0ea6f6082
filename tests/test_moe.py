"""Routed experts (MoE) in PI2: MUL_MAT_ID of blk.N.ffn_{gate,up,down}_exps.weight on the three layouts llama.cpp
runs (llama, qwen3moe, smallthinker), synthetic models made by our tools. Each MoE layer's output through the
plugin is compared with a numpy computation of the same layer from the GGUF's weights, on the layer input llama
computed; only the routed experts are computed, and for ReLU-family experts only the up rows of fired neurons."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

import pi2_gguf
from pi2_gguf.bench import cgroup
from pi2_gguf.converter import synthetic, synthetic_moe
from pi2_gguf.errors import MemoryBudgetError, Pi2Error
from pi2_gguf.runtime.isolated import greedy_in_subprocess
from pi2_gguf.runtime.runner import LlamaRunner

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from decode_steps import decode  # noqa: E402
from kernel_probe import io_uring_available  # noqa: E402

PROMPT = "The history of the Roman Empire begins with the founding of the city"
FATRELU_T = 0.05
# (arch, activation, n_expert, n_expert_used)
CASES = [("llama", "drelu", 8, 2), ("qwen3moe", "fatrelu", 16, 4), ("smallthinker", "relu", 8, 2), ("llama", "silu", 8, 2)]


def _shape(n_expert: int, n_used: int) -> synthetic_moe.MoeShape:
    return synthetic_moe.MoeShape(n_embd=256, n_ff=512, n_layer=3, n_head=4, n_head_kv=2, n_expert=n_expert,
                                  n_expert_used=n_used, n_ctx=512)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple, Path]:
    arch, act, ne, nu = request.param
    path = tmp_path_factory.mktemp("moe") / f"{arch}-{act}.gguf"
    synthetic_moe.make_moe(path, _shape(ne, nu), synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           arch, act, QT.F32, threshold=FATRELU_T, progress=False)
    return request.param, path


def _numpy_moe(r: GGUFReader, il: int, x: np.ndarray, logits: np.ndarray, act: str, n_used: int) -> tuple[np.ndarray, int]:
    """llama.cpp's build_moe_ffn with softmax gating and normalized weights, in float64: x [n_tok, n_embd], the
    router's logits [n_tok, n_expert] as llama computed them (smallthinker's router reads the layer input, the
    others' the FFN input). Also the number of (token, routed expert, neuron) whose gate passes the ReLU-family cut."""
    t = {f.name: np.asarray(f.data, np.float64) for f in r.tensors if f.name.startswith(f"blk.{il}.ffn_")}
    gate, up, down = (t[f"blk.{il}.ffn_{k}.weight"] for k in ("gate_exps", "up_exps", "down_exps"))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    fired = 0
    for i in range(x.shape[0]):
        sel = np.argsort(-p[i], kind="stable")[:n_used]
        w = p[i, sel] / p[i, sel].sum()
        for e, we in zip(sel, w):
            g, u = gate[e] @ x[i], up[e] @ x[i]
            fired += int(np.sum(g > (FATRELU_T if act == "fatrelu" else 0.0)))
            if act == "silu":
                a = g / (1 + np.exp(-g)) * u
            elif act == "drelu":
                a = np.maximum(g, 0) * np.maximum(u, 0)
            elif act == "fatrelu":
                a = np.where(g > FATRELU_T, g, 0) * u
            else:
                a = np.maximum(g, 0) * u
            out[i] += we * (down[e] @ a)
    return out, fired


def _layers(path: Path, out_name: str, settings: dict | None = None) -> tuple[dict, dict, dict]:
    """Per layer, the MoE input (ffn_norm), router logits and output llama computed with the plugin for PROMPT,
    token by token after the first 4 (so decode steps run too)."""
    seen: dict[tuple[str, int], list[np.ndarray]] = {}

    def sink(layer: int, name: str, a: np.ndarray) -> None:
        seen.setdefault((name, layer), []).append(a.copy())

    pi2_gguf.register()
    runner = LlamaRunner(path, n_ctx=128, n_threads=2, watch=("ffn_norm", "ffn_moe_logits", out_name), sink=sink, repack=False,
                         settings=settings)
    try:
        toks = runner.tokenize(PROMPT)
        runner.decode(toks[:4])
        for i in range(4, len(toks)):
            runner.decode([toks[i]])
    finally:
        runner.close()
    ins = {il: np.concatenate(v) for (n, il), v in seen.items() if n == "ffn_norm"}
    logits = {il: np.concatenate(v) for (n, il), v in seen.items() if n == "ffn_moe_logits"}
    outs = {il: np.concatenate(v) for (n, il), v in seen.items() if n == out_name}
    return ins, logits, outs


def test_moe_layers_equal_numpy(moe_model: tuple[tuple, Path]) -> None:
    (arch, act, _, n_used), path = moe_model
    r = GGUFReader(path)
    pi2_gguf.reset_counters()
    # smallthinker's graph renames the MoE output ffn_out; llama's ffn_out is the residual sum after it
    ins, logits, outs = _layers(path, "ffn_out" if arch == "smallthinker" else "ffn_moe_out",
                                settings=None if act != "silu" else {"layers": "all"})
    c = pi2_gguf.read_counters()
    n_tok = ins[0].shape[0]
    assert len(outs) == 3 and n_tok > 8
    fired = []
    for il in range(3):
        ref, f = _numpy_moe(r, il, ins[il].astype(np.float64), logits[il].astype(np.float64), act, n_used)
        err = np.abs(outs[il] - ref).max()
        assert err <= 1e-4 * np.abs(ref).max(), (il, err)
        fired.append(f)
    # only the routed experts: n_expert_used a token, and each expert read at most once a batch
    assert (c.expert_tokens[:3] == n_tok).all()
    assert (c.experts_routed[:3] == n_used * n_tok).all()
    assert (c.expert_neurons[:3] == 512 * n_used * n_tok).all()
    assert (c.experts_loaded[:3] <= c.experts_routed[:3]).all() and (c.experts_loaded[:3] > 0).all()
    # up rows: only the fired neurons' for the ReLU family, all of them for SiLU
    assert (c.rows[:3, 1] == c.expert_active[:3]).all() and (c.rows[:3, 0] == c.expert_neurons[:3]).all()
    if act == "silu":
        assert (c.expert_active[:3] == c.expert_neurons[:3]).all()
    else:  # as many as numpy counts on the same inputs (float rounding may move a gate across the cut)
        assert np.abs(c.expert_active[:3].astype(float) - fired).max() <= 1e-3 * max(fired)
        assert (c.expert_active[:3] < 0.95 * c.expert_neurons[:3]).all()


def test_unpatched_graph_differs_without_the_plugin(moe_model: tuple[tuple, Path]) -> None:
    """llama.cpp alone computes SwiGLU for llama/qwen3moe experts (ReGLU for smallthinker's): for a model that
    states another activation its logits differ from the plugin's, which the test above checks against numpy."""
    (arch, act, _, _), path = moe_model
    if (arch, act) in (("llama", "silu"), ("smallthinker", "relu")):
        pytest.skip("the graph's own activation is the stated one")
    alone = greedy_in_subprocess(path, [PROMPT], 2, pi2=False, repack=False)[0]
    plugin = greedy_in_subprocess(path, [PROMPT], 2, pi2=True)[0]
    assert plugin.pi2_matmuls > 0
    ref = np.array(plugin.logits_first)
    assert np.abs(np.array(alone.logits_first) - ref).max() > 1e-2 * np.abs(ref).max()


def test_quantized_silu_experts_equal_stock(tmp_path: Path) -> None:
    """Q4_K experts held by PI2 (layers=all): decode logits bit-identical to stock llama.cpp with repacking off (the
    same vec_dot per row); prompts run in ggml-cpu either way."""
    path = tmp_path / "q4k.gguf"
    synthetic_moe.make_moe(path, _shape(8, 2), synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           "qwen3moe", "silu", QT.Q4_K, progress=False)
    ref = greedy_in_subprocess(path, [PROMPT], 16, pi2=False, repack=False)[0]
    run = greedy_in_subprocess(path, [PROMPT], 16, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert run.pi2_matmuls > 0 and run.tokens == ref.tokens and run.layers_in_pi2 == "3/3"
    assert np.array_equal(np.array(run.logits_first), np.array(ref.logits_first))


def test_silu_experts_are_placed_by_the_cost_rule(tmp_path: Path) -> None:
    """In RAM in predicted mode (PI2_LAYERS=auto) a SiLU MoE's experts are held only where the mean estimated cost of
    the layer's experts is below 1, the rule dense layers follow. The default sidecar (product criterion: ~1.6) leaves
    every expert to ggml-cpu, which then gives stock llama.cpp's logits (repacked) bit for bit, and layers_left()
    lists every (layer, expert); a 0.4 threshold (~0.4) holds them all and PI2 computes them."""
    from pi2_gguf.converter.convert import convert
    from pi2_gguf.runtime import native

    path = tmp_path / "silu.gguf"
    synthetic_moe.make_moe(path, _shape(8, 2), synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           "qwen3moe", "silu", QT.Q4_K, progress=False)
    loose = convert(path, tmp_path / "loose.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                    perplexity_budget=None, expert_reads="bundles").path
    tight = convert(path, tmp_path / "tight.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                    perplexity_budget=None, threshold=0.4, expert_reads="bundles").path
    mean = {sc: [float(np.mean(native.sparse_cost_c(sc)[il * 8:(il + 1) * 8])) for il in range(3)] for sc in (loose, tight)}
    assert min(mean[loose]) >= 1.0 and max(mean[tight]) < 1.0, mean  # both kinds, or the test shows nothing
    auto = {"layers": "auto"}
    stock = greedy_in_subprocess(path, [PROMPT], 8, pi2=False)[0]
    left = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, sidecar=loose, mode="predicted", settings=auto)[0]
    assert left.pi2_matmuls == 0 and left.tokens == stock.tokens
    assert np.array_equal(np.array(left.logits_first), np.array(stock.logits_first))
    held = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, sidecar=tight, mode="predicted", settings=auto)[0]
    assert held.layers_in_pi2 == "3/3"
    for sc, want in ((loose, list(range(3 * 8))), (tight, [])):
        llm = pi2_gguf.Llama(str(path), sidecar=sc, mode="predicted", n_ctx=128, n_threads=2, verbose=False, settings=auto)
        try:
            assert llm.layers_left() == want
        finally:
            llm.close()


def test_experts_the_graph_computes_itself_are_left_to_ggml_cpu(moe_model: tuple[tuple, Path]) -> None:
    """Without PI2_LAYERS=all a model's routed experts are held only where llama.cpp's own MoE graph would compute
    another activation than the model states: smallthinker's ReLU experts (llama.cpp builds them as ReGLU) are left to
    ggml-cpu and give stock llama.cpp's logits (repacked) bit for bit; llama's dReLU and qwen3moe's FATReLU (SwiGLU
    in llama.cpp's graph) are held; SiLU experts without a sidecar are left."""
    (arch, act, _, _), path = moe_model
    stock = greedy_in_subprocess(path, [PROMPT], 4, pi2=False)[0]
    run = greedy_in_subprocess(path, [PROMPT], 4, pi2=True, settings={"layers": "auto"})[0]
    if arch == "smallthinker" or act == "silu":
        assert run.pi2_matmuls == 0 and run.tokens == stock.tokens
        assert np.array_equal(np.array(run.logits_first), np.array(stock.logits_first))
    else:
        assert run.pi2_matmuls > 0 and run.layers_in_pi2 == "3/3"


def test_gpt_oss_shaped_model_from_flash(tmp_path: Path) -> None:
    """make_moe's gpt-oss layout, as the published files are typed (MXFP4 experts, Q8_0 attention and embeddings, f32
    biases and sinks, an output matrix of its own): llama.cpp loads it; PI2 holding every layer gives stock's tokens
    and logits; convert makes a sidecar (SwiGLU-OAI), and each mode under a budget gives the in-RAM run's tokens."""
    from pi2_gguf.converter.convert import convert

    path = tmp_path / "oss.gguf"
    synthetic_moe.make_moe(path, _shape(8, 2), synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5),
                           "gpt-oss", "silu", QT.MXFP4, progress=False)
    r = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ffn_up_exps.bias"] == "F32" and types["output.weight"] == "Q8_0"
    assert r.get_field("gpt-oss.ffn_activation") is None  # its graph builds SwiGLU-OAI: nothing is stated
    stock = greedy_in_subprocess(path, [PROMPT], 8, pi2=False, repack=False)[0]
    held = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0 and held.tokens == stock.tokens
    assert np.abs(np.array(held.logits_first) - np.array(stock.logits_first)).max() <= 1e-4 * np.abs(stock.logits_first).max()
    sidecar = convert(path, tmp_path / "oss.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                      perplexity_budget=None, expert_reads="bundles")
    assert sidecar.meta.activation == "swiglu_oai"
    for mode in ("oracle", "predicted"):
        ram = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, repack=False, sidecar=sidecar.path, mode=mode,
                                   settings={"layers": "all", "sparse_batch": 64})[0]
        flash = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, sidecar=sidecar.path, mode=mode, memory_budget=2 << 30,
                                     settings={"cache_max": "256KiB", "sparse_batch": 64})[0]
        assert flash.tokens == ram.tokens and flash.io["expert_misses"] > 0, (mode, flash.io)


def test_deepseek2_shaped_model_from_flash(tmp_path: Path) -> None:
    """make_moe's deepseek2 layout (DeepSeek-V2-Lite's: latent attention, a dense first layer, shared experts beside
    the routed ones, softmax routing): llama.cpp loads it; PI2 holding every layer gives stock's tokens; convert
    --expert-reads model makes a sidecar of the dense layer and the shared experts only, and under a budget that
    reads the routed experts whole from the model file, dense and predicted modes give the in-RAM tokens."""
    from dataclasses import replace

    from pi2_gguf.converter.convert import convert

    path = tmp_path / "ds.gguf"
    shape = replace(_shape(8, 2), n_head=2, n_head_kv=1, n_rot=synthetic_moe.MLA_ROPE, n_dense_lead=1, n_ff_dense=768,
                    n_shared=2)
    synthetic_moe.make_moe(path, shape, synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5), "deepseek2",
                           "silu", QT.Q8_0, progress=False)
    r = GGUFReader(path)
    names = {t.name for t in r.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight",
            "blk.1.attn_kv_a_mqa.weight", "blk.1.attn_k_b.weight"} <= names and "blk.0.ffn_gate_inp.weight" not in names
    assert r.get_field("deepseek2.leading_dense_block_count").contents() == 1
    stock = greedy_in_subprocess(path, [PROMPT], 8, pi2=False, repack=False)[0]
    held = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0 and held.tokens == stock.tokens
    sidecar = convert(path, tmp_path / "ds.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                      perplexity_budget=None, expert_reads="model")
    for mode in ("dense", "predicted"):
        ram = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, repack=False, sidecar=sidecar.path, mode=mode,
                                   settings={"layers": "all", "sparse_batch": 64})[0]
        flash = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, sidecar=sidecar.path, mode=mode, memory_budget=2 << 30,
                                     settings={"cache_max": "1MiB", "sparse_batch": 64})[0]
        assert flash.tokens == ram.tokens and flash.io["expert_bytes"] > 0 and flash.io["expert_misses"] > 0, (mode, flash.io)


def test_convert_progress_counts_only_the_layers_it_plans_and_writes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """convert --expert-reads model: routed experts read whole are neither planned nor written, so the steps whose
    rates make the time left count only the dense layer and the shared experts (a DeepSeek-V2-Lite-shaped model's
    1,664 whole experts had the write step estimated at ~2 hours, as many layers as the 27 it writes)."""
    from dataclasses import replace

    from pi2_gguf.converter import eta
    from pi2_gguf.converter.convert import convert
    from pi2_gguf.sidecar.reader import read as read_sidecar

    path = tmp_path / "ds.gguf"
    shape = replace(_shape(8, 2), n_head=2, n_head_kv=1, n_rot=synthetic_moe.MLA_ROPE, n_dense_lead=1, n_ff_dense=768,
                    n_shared=2)
    synthetic_moe.make_moe(path, shape, synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5), "deepseek2",
                           "silu", QT.Q8_0, progress=False)
    units: dict[str, tuple[str, float]] = {}
    done: dict[str, float] = {}
    expect, advance = eta.Progress.expect, eta.Progress.advance

    def record_expect(self: eta.Progress, step: str, kind: str, n: float) -> None:
        units[step] = (kind, n)
        expect(self, step, kind, n)

    def record_advance(self: eta.Progress, step: str, n: float = 1.0, timed: bool = True) -> None:
        done[step] = done.get(step, 0.0) + n
        advance(self, step, n, timed)

    monkeypatch.setattr(eta.Progress, "expect", record_expect)
    monkeypatch.setattr(eta.Progress, "advance", record_advance)
    res = convert(path, tmp_path / "ds.pi2.gguf", train_tokens=512, heldout_tokens=128, progress=False,
                  perplexity_budget=None, expert_reads="model")
    sc = read_sidecar(res.path)
    planned = sc.n_layer - len(sc.whole_layers)
    assert planned == 3 and len(sc.whole_layers) == 16  # the dense layer, 2 layers' shared experts; 2 x 8 routed
    assert units["write"] == ("write", planned) and done["write"] == planned
    layer_steps = [k for k, (kind, _) in units.items() if kind == "layer"]
    assert layer_steps and all(units[k][1] == planned and done[k] == planned for k in layer_steps), (units, done)


def test_deepseek2_lite_layout_at_its_layer_count(tmp_path: Path) -> None:
    """At DeepSeek-V2-Lite's 27 layers llama.cpp reads a deepseek2 model without a query LoRA (one attn_q matrix, no
    q_lora_rank key): make_moe writes that layout there (the LoRA one failed to load), and PI2 gives stock's tokens."""
    from dataclasses import replace

    path = tmp_path / "ds27.gguf"
    shape = replace(_shape(8, 2), n_layer=27, n_head=2, n_head_kv=1, n_rot=synthetic_moe.MLA_ROPE, n_dense_lead=1,
                    n_ff_dense=256, n_shared=1)
    assert synthetic_moe.mla_lite(27, 1000) and not synthetic_moe.mla_lite(5, 1000)
    synthetic_moe.make_moe(path, shape, synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5), "deepseek2",
                           "silu", QT.Q8_0, progress=False)
    r = GGUFReader(path)
    names = {t.name for t in r.tensors}
    assert {"blk.0.attn_q.weight", "blk.26.attn_q.weight", "blk.26.ffn_gate_exps.weight"} <= names
    assert not any(".attn_q_a" in n or ".attn_q_b" in n for n in names)
    assert r.get_field("deepseek2.attention.q_lora_rank") is None
    stock = greedy_in_subprocess(path, [PROMPT], 8, pi2=False, repack=False)[0]
    held = greedy_in_subprocess(path, [PROMPT], 8, pi2=True, repack=False, settings={"layers": "all"})[0]
    assert held.pi2_matmuls > 0 and held.tokens == stock.tokens


def test_dense_reads_are_a_dense_model_s_choice(tmp_path: Path) -> None:
    """convert --dense-reads model on an MoE model is refused by name before anything is profiled (--expert-reads
    chooses for its routed experts)."""
    from pi2_gguf.converter.convert import convert

    path = tmp_path / "m.gguf"
    synthetic_moe.make_moe(path, _shape(4, 2), synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5),
                           progress=False)
    with pytest.raises(Pi2Error, match="--dense-reads model: m.gguf is an MoE model"):
        convert(path, tmp_path / "m.pi2.gguf", dense_reads="model", progress=False)
    assert not (tmp_path / "m.pi2.gguf").exists()


def test_make_moe_refuses_bad_shapes(tmp_path: Path) -> None:
    sp, ro = synthetic.Sparsity(density=0.15), synthetic_moe.Routing()
    with pytest.raises(Pi2Error, match="n-expert-used"):
        synthetic_moe.make_moe(tmp_path / "a.gguf", _shape(4, 5), sp, ro, progress=False)
    with pytest.raises(Pi2Error, match="ReLU-family"):
        synthetic_moe.make_moe(tmp_path / "b.gguf", _shape(8, 2), sp, ro, "smallthinker", "silu", progress=False)
    with pytest.raises(Pi2Error, match="SwiGLU-OAI"):
        synthetic_moe.make_moe(tmp_path / "d.gguf", _shape(8, 2), sp, ro, "gpt-oss", "relu", progress=False)
    with pytest.raises(Pi2Error, match="dense first layers"):
        synthetic_moe.make_moe(tmp_path / "e.gguf", _shape(8, 2), sp, ro, "deepseek2", "silu", progress=False)
    with pytest.raises(Pi2Error, match="locality"):
        synthetic_moe.make_moe(tmp_path / "c.gguf", _shape(8, 2), sp, synthetic_moe.Routing(1.0, 1.5), progress=False)
    assert not list(tmp_path.iterdir())


def test_make_model_moe_calibrates_and_reports_routing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tools/make_model.py --n-expert: calibrated gate densities near the target on held-out text, and the LRU
    expert-cache hit curve (rising with the cache size) in its report."""
    from tool_script import load_tool

    mm = load_tool("make_model")
    out = tmp_path / "moe.gguf"
    rc = mm.main([str(out), "--n-embd", "256", "--n-ff", "512", "--n-layer", "3", "--n-head", "4", "--n-head-kv", "2",
                  "--n-expert", "8", "--n-expert-used", "2", "--arch", "qwen3moe", "--activation", "relu",
                  "--density", "0.15", "--type", "F32", "--calib-tokens", "256", "--heldout-tokens", "256"])
    assert rc == 0
    text = capsys.readouterr().out
    rows = [line.split("|") for line in text.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 3
    for r in rows:
        target, measured = float(r[1]), float(r[2])
        assert abs(measured - target) <= 0.35 * target, (target, measured)
        hits = [float(x) for x in r[4:]]
        assert hits == sorted(hits) and 0.0 <= hits[0] and hits[-1] <= 1.0
    assert "mean LRU hit rate" in text
    with pytest.raises(SystemExit):
        mm.main([str(tmp_path / "x.gguf"), "--n-expert", "-1"])


@pytest.fixture(scope="module")
def moe_sidecar(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A dReLU llama-layout MoE model (F32, expert gates calibrated to 0.15) and its converted sidecar."""
    from pi2_gguf.converter.convert import convert

    d = tmp_path_factory.mktemp("moe-sparse")
    model = d / "moe.gguf"
    synthetic_moe.make_moe(model, _shape(8, 2), synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           "llama", "drelu", QT.F32, progress=False, calib_tokens=256)
    sidecar = convert(model, d / "moe.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                      perplexity_budget=None).path
    return model, sidecar


def test_moe_sidecar_describes_each_expert(moe_sidecar: tuple[Path, Path]) -> None:
    from pi2_gguf.sidecar.reader import read as read_sidecar

    model, sidecar = moe_sidecar
    kv = read_sidecar(sidecar).kv
    assert kv["pi2.moe.expert_count"] == 8 and len(kv["pi2.n_ff"]) == 3 * 8
    assert kv["pi2.activation"] == "drelu"
    assert kv["pi2.moe.expert_reads"] == "bundles"  # convert's default for ReLU-family experts: only firing neurons read
    assert all(0.02 < d < 0.3 for d in kv["pi2.sparsity.density"])  # active: gate > 0 and up > 0
    share = np.array(kv["pi2.moe.routed_share"]).reshape(3, 8)
    assert np.allclose(share.sum(axis=1), 2.0, atol=1e-5)  # each token routed to n_expert_used = 2 experts
    from pi2_gguf.sidecar.inspect import summary
    from pi2_gguf.sidecar.reader import read as read_sc

    text = summary(read_sc(sidecar))
    assert "3 layers of 8 routed experts" in text and text.count("(hottest ") == 3
    # the disk the sidecar adds beside the model, and of what
    disk = re.search(r"model ([0-9.]+) MB \+ sidecar ([0-9.]+) MB = ([0-9.]+) MB.*neuron bundles ([0-9.]+) MB", text)
    assert disk is not None, text
    assert float(disk[1]) == round(model.stat().st_size / 1e6, 1)
    assert float(disk[2]) == round(sidecar.stat().st_size / 1e6, 1)
    assert 0 < float(disk[4]) < float(disk[2])


def test_moe_oracle_equals_dense_and_predicted_agrees(moe_sidecar: tuple[Path, Path]) -> None:
    """Sparse decode inside the routed experts: oracle (exact for dReLU) gives dense's tokens for 64 tokens, predicted
    agrees on >= 99%; each decode token runs the sparse engine once per routed expert and layer."""
    model, sidecar = moe_sidecar
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="dense", n_ctx=256, n_threads=2, verbose=False)
    try:
        dense_toks, dense_logits = decode(llm, PROMPT, 64)
        llm.set_mode("oracle")
        oracle_toks, oracle_logits = decode(llm, PROMPT, 64)
        assert oracle_toks == dense_toks
        assert np.abs(oracle_logits - dense_logits).max() <= 1e-4 * np.abs(dense_logits).max()
        pi2_gguf.reset_counters()
        for t in dense_toks[:16]:
            llm.eval([t])
        c = pi2_gguf.read_counters()
        assert (c.experts_routed[:3] == 16 * 2).all()
        # the engine's counters are per sidecar layer (layer * n_expert + expert): one token per routed pair
        assert c.sparse_tokens[:24].sum() == 16 * 2 * 3
        assert 0.02 < c.active.sum() / c.neurons.sum() < 0.3
        llm.set_mode("predicted")
        pred_toks, _ = decode(llm, PROMPT, 64, forced=dense_toks)
        assert sum(a == b for a, b in zip(pred_toks, dense_toks)) >= 0.99 * 64
    finally:
        llm.close()


def test_expert_guess_tool_reports_each_layer(moe_sidecar: tuple[Path, Path]) -> None:
    """tools/expert_guess.py: per layer the share of the next layer's top-k that its router picks from this layer's FFN
    input, a share in [0, 1] for all layers but the last, and the mean against chance (2 of 8)."""
    import subprocess

    model, _ = moe_sidecar
    tool = Path(__file__).resolve().parent.parent / "tools" / "expert_guess.py"
    out = subprocess.run([sys.executable, str(tool), str(model), "-n", "64"], capture_output=True, text=True, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if re.match(r"^\s*\d+ \|", line)]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    guess = [float(r[1]) for r in rows]
    assert all(0.0 <= g <= 1.0 for g in guess[:2]) and np.isnan(guess[2])
    assert "chance 0.250" in out
    bad = subprocess.run([sys.executable, str(tool), str(model.with_suffix(".missing"))], capture_output=True, text=True)
    assert bad.returncode != 0 and "no such file" in bad.stderr


def test_moe_sidecar_of_another_model_is_refused(moe_sidecar: tuple[Path, Path], tmp_path: Path) -> None:
    model, sidecar = moe_sidecar
    other = tmp_path / "other.gguf"
    synthetic_moe.make_moe(other, _shape(8, 2), synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5),
                           "llama", "drelu", QT.F32, seed=1, progress=False)
    with pytest.raises(Pi2Error, match="another model|made for"):
        llm = pi2_gguf.Llama(str(other), sidecar=sidecar, mode="oracle", n_ctx=128, n_threads=2, verbose=False)
        try:
            decode(llm, PROMPT, 2)
        finally:
            llm.close()


@pytest.mark.parametrize("cache_max,ahead,guess,engine", [
    ("1MiB", "0", "off", None), ("1MiB", "16", "off", None), ("8MiB", "16", "off", None), ("1MiB", "16", "router", None),
    ("8MiB", "16", "router", None), ("1MiB", "16", "router", "threads")])
def test_moe_flash_decode_equals_in_ram(moe_sidecar: tuple[Path, Path], cache_max: str, ahead: str, guess: str,
                                        engine: str | None) -> None:
    """Under a memory budget the experts live in the sidecar on flash: each routed expert's active neurons are read
    through the neuron cache; the tokens and logits equal in-RAM sparse decode run by the same engine, with a batch's
    routed experts read before the first computes (PI2_EXPERT_AHEAD) or each when it computes (0), with or without
    the next layer's experts guessed and read ahead (PI2_EXPERT_GUESS), in a cache with room to read ahead (8 MiB)
    or hardly any (1 MiB). (In RAM the pairs run one per thread, on flash in turn on both threads.) The prompt too runs
    token by token on both (PI2_SPARSE_BATCH 64): on flash a prompt batch otherwise runs expert by expert as a batch
    (test_moe_flash_prompt_batches_read_each_expert_once). Bundles are read through io_uring (PI2_IO_ENGINE's default
    where the kernel allows it) or on I/O threads."""
    model, sidecar = moe_sidecar
    same_engine = {"sparse_batch": 64, "down_sparse_max": 1.0}
    ram = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", n_ctx=256, n_threads=2, verbose=False,
                         settings=same_engine)
    try:
        want, want_logits = decode(ram, PROMPT, 16)
    finally:
        ram.close()
    flash = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", n_ctx=256, n_threads=2, verbose=False,
                           memory_budget="2GiB", settings={"cache_max": cache_max, "expert_ahead": ahead,
                                                           "expert_guess": guess, "sparse_batch": 64,
                                                           **({"io_engine": engine} if engine else {})})
    try:
        pi2_gguf.reset_counters()
        got, got_logits = decode(flash, PROMPT, 16)
        c = pi2_gguf.read_counters()
        info = flash.cache_info()
        n_tok = len(flash.tokenize(PROMPT.encode(), add_bos=True)) + 16
    finally:
        flash.close()
    assert got == want and np.array_equal(got_logits, want_logits)
    assert info is not None and info.io_ring == (engine != "threads" and io_uring_available())
    assert int(c.misses.sum()) > 0 and int(c.bytes_read.sum()) > 0
    # every token (prompt too: on flash all batches run the engine) through n_expert_used = 2 experts in each layer;
    # llama prunes the last layer to the tokens whose logits it returns (the prompt's last, then each step's)
    assert int(c.sparse_tokens.sum()) == 2 * (2 * n_tok + 16 + 1), int(c.sparse_tokens.sum())
    # each routed pair an expert hit (all it wanted cached) or miss; reads ahead are the misses' reads, found read
    assert int(c.expert_hits.sum() + c.expert_misses.sum()) == int(c.experts_routed.sum()) > 0
    assert int(c.expert_misses.sum()) > 0
    if ahead == "0":
        assert int(c.prefetched.sum()) == 0
    else:
        assert 0 < int(c.prefetched.sum()) <= int(c.misses.sum())
    if guess == "router" and cache_max == "8MiB":
        # each batch of layers 0 and 1 guesses the next layer's experts (so never layer 0's), and those are the
        # experts the next layer routes to far more often than chance (2 of 8 a token)
        assert int(c.experts_guessed[0]) == 0 and (c.experts_guessed[1:3] > 0).all(), c.experts_guessed[:3]
        assert (c.experts_guessed_routed[:3] <= np.minimum(c.experts_guessed[:3], c.experts_loaded[:3])).all()
        recall = c.experts_guessed_routed[1:3].sum() / c.experts_loaded[1:3].sum()
        assert recall > 0.5, (c.experts_guessed_routed[:3], c.experts_loaded[:3])
    elif guess == "off":
        assert int(c.experts_guessed.sum()) == 0 and int(c.experts_guessed_routed.sum()) == 0


@pytest.mark.skipif(cgroup.available() is not None, reason=str(cgroup.available()))
def test_moe_bench_reports_expert_hits(moe_sidecar: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    """`pi2-gguf bench --decode text` on an MoE model: the pi2 row under the limit reports the share of routed experts
    that read nothing and the share read ahead on the next-layer router's guess, and the table has their columns;
    every configuration decodes the held-out text. A peer row (--peer: here stock llama.cpp's own llama-completion,
    a real engine every test run has) runs under the same limit and reports the rate it printed."""
    from pi2_gguf.bench.memory_limit import Row, format_table
    from pi2_gguf.cli import main

    model, sidecar = moe_sidecar
    with pytest.raises(MemoryBudgetError) as e:
        pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="1MB", n_ctx=256, n_threads=2, verbose=False)
    limit = int(re.search(r"needs (?:at least|more than) (\d+) MB", str(e.value)).group(1)) * 1_000_000 + 40_000_000
    monkeypatch.setenv("PI2_CACHE_MAX", str(2 << 20))  # most bundles on flash
    out = tmp_path / "bench.json"
    with out.open("w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        peer = f"llama={Path(sys.executable).parent / 'llama-completion'} -m {{model}} -p {{prompt}} -n {{n}} -t {{threads}}"
        assert main(["bench", str(model), "--memory-limit", str(limit), "--sidecar", str(sidecar), "-n", "8",
                     "--decode", "text", "--skip-unlimited", "--skip-stock-defaults", "--json", "--peer", peer]) == 0
    monkeypatch.undo()
    data = json.loads(out.read_text())
    assert data["decode"] == "text"
    pi2 = next(r for r in data["rows"] if r["name"].startswith("pi2, memory budget"))
    assert pi2["status"] == "ok" and pi2["moe"] and 0 <= pi2["expert_hit_rate"] < 1 and pi2["decoded"] == 8
    assert 0 < pi2["expert_guess_rate"] <= 1
    assert not any(r["moe"] for r in data["rows"] if r["name"].startswith("stock"))
    stock = [r["name"] for r in data["rows"] if r["name"].startswith("stock")]
    assert stock == ["stock llama.cpp, mmap, repack off"], stock  # --skip-stock-defaults: the baseline row alone
    peer_row = next(r for r in data["rows"] if r["peer"])
    assert peer_row["name"] == "llama (peer, greedy)" and peer_row["status"] == "ok" and peer_row["decode_tps"] > 0
    assert 0 < peer_row["peak_mb"] <= limit / 1e6 + 1
    table = format_table(model, limit, None, [Row(**{**r, "rounds": []}) for r in data["rows"]], "text")
    assert "| expert hits | experts guessed |" in table and "teacher forcing" in table
    assert f"| {pi2['expert_hit_rate']:.1%} | {pi2['expert_guess_rate']:.1%} |" in table


def test_expert_reuse_counts_consecutive_tokens_within_windows() -> None:
    """pi2.moe.reuse: of the tokens routed to an expert, the share whose next token is routed there too; the pair
    across a profile window's boundary is not consecutive text."""
    from pi2_gguf.converter.profile import expert_reuse

    routes = np.array([[0, 1], [0, 2], [3, 1], [0, 1], [0, 2], [0, 2]])  # windows of 3: tokens 0-2 and 3-5
    assert expert_reuse(routes, 4, 3) == [0.75, 0.0, 0.5, 0.0]
    assert expert_reuse(routes, 4, 6) == pytest.approx([0.75, 1 / 3, 0.5, 0.0])  # one window: token 2 -> 3 counts too


def test_moe_sidecar_records_reuse(moe_sidecar: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from pi2_gguf.cli import main
    from pi2_gguf.sidecar.reader import read as read_sidecar

    _, sidecar = moe_sidecar
    reuse = np.array(read_sidecar(sidecar).kv["pi2.moe.reuse"])
    assert reuse.shape == (3 * 8,) and ((reuse >= 0) & (reuse <= 1)).all() and reuse.max() > 0
    assert main(["inspect", str(sidecar)]) == 0
    assert "reuse" in capsys.readouterr().out


def test_moe_flash_prompt_batches_read_each_expert_once(moe_sidecar: tuple[Path, Path]) -> None:
    """A prompt batch on flash runs each routed expert once, as one FFN over the tokens routed to it (batch_ffn.h):
    a layer reads at most the bundles of the experts it routes to, each once, though the cache holds about 4 of 8.
    Fed one token at a time, a layer's experts take turns in the cache and are read again and again; as a batch run
    pair by pair (PI2_SPARSE_BATCH 64), each pair reads its own predicted neurons and the gaps bridged between them,
    which the expert's next pair reads again. In oracle mode the batch computes every neuron's gate for every routed
    token, for dReLU experts the exact set: its logits are the pair-by-pair oracle engine's up to float rounding."""
    from pi2_gguf.runtime.generate import last_logits
    from pi2_gguf.sidecar.reader import read as read_sidecar

    model, sidecar = moe_sidecar
    sc = read_sidecar(sidecar)
    expert_bytes = max(sc.bundles(v).nbytes for v in range(sc.n_layer))

    def prompt(mode: str, how: str) -> tuple[np.ndarray, pi2_gguf.Counters]:
        llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode=mode, n_ctx=256, n_threads=2, verbose=False,
                             memory_budget="2GiB", settings={"cache_max": "8MiB", "expert_ahead": "0", "expert_guess": "off",
                                                             "sparse_batch": 64 if how == "pairs" else 4})
        try:
            toks = llm.tokenize((PROMPT + " " + PROMPT).encode(), add_bos=True)
            assert 4 < len(toks) <= 32  # one batch past PI2_SPARSE_BATCH, within the budget's n_batch
            pi2_gguf.reset_counters()
            for batch in [[t] for t in toks] if how == "alone" else [toks]:
                llm.eval(batch)
            c = pi2_gguf.read_counters()
            return last_logits(llm).copy(), c
        finally:
            llm.close()

    _, c = prompt("predicted", "batch")
    _, alone = prompt("predicted", "alone")
    _, pairs = prompt("predicted", "pairs")
    batch, routed = c.bytes_read[:2], c.experts_loaded[:2]  # llama prunes the last layer to the prompt's last token
    assert (routed >= 6).all(), routed  # most of a layer's 8 experts: more than the cache holds
    assert (batch > 0).all() and (batch <= routed * expert_bytes).all(), (batch, routed * expert_bytes)
    assert (batch <= 0.5 * alone.bytes_read[:2]).all() and (batch <= pairs.bytes_read[:2]).all() and \
        int(batch.sum()) < int(pairs.bytes_read[:2].sum()), (batch, alone.bytes_read[:2], pairs.bytes_read[:2])
    assert int(c.expert_hits.sum() + c.expert_misses.sum()) == int(c.experts_routed.sum())
    got, _ = prompt("oracle", "batch")
    want, _ = prompt("oracle", "pairs")
    assert np.argmax(got) == np.argmax(want)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()


def test_expert_share_note_only_where_a_layer_gets_fewer_entries_than_a_token_routes() -> None:
    """`pi2-gguf run -v`'s expert cache line: a note where the cache's even split gives a layer fewer entries than the
    experts a token routes to there (the case whole reads lose to bundles), none where it holds them or before
    any token was routed."""
    from pi2_gguf.cli import expert_share_note

    assert "6.0 a layer, fewer than the 8 experts a token routes to" in expert_share_note(48, 8, 8.0)
    assert "0.5 a layer" in expert_share_note(4, 8, 2.0)  # fewer entries than layers: one pool for all
    assert expert_share_note(64, 8, 8.0) == ""            # 8 a layer: a token's experts fit
    assert expert_share_note(48, 8, 0.0) == "" and expert_share_note(0, 8, 8.0) == ""


def test_run_verbose_names_an_expert_cache_smaller_than_a_tokens_experts(tmp_path: Path) -> None:
    """A SiLU MoE model converted with defaults reads its experts whole (--expert-reads auto), and `pi2-gguf run -v`
    under a budget whose expert cache gives each routed layer fewer entries than a token routes to there says so;
    with room for every expert it does not."""
    import os
    import subprocess

    from pi2_gguf.converter.convert import convert

    path = tmp_path / "q3moe.gguf"
    synthetic_moe.make_moe(path, _shape(8, 2), synthetic.Sparsity(density=0.5), synthetic_moe.Routing(1.0, 0.5),
                           "qwen3moe", "silu", QT.Q8_0, progress=False)
    sidecar = convert(path, tmp_path / "q3moe.pi2.gguf", train_tokens=512, heldout_tokens=128, progress=False,
                      perplexity_budget=None)
    assert sidecar.meta.expert_reads == "model"

    def run(cache_max: str) -> str:
        res = subprocess.run([sys.executable, "-m", "pi2_gguf.cli", "run", str(path), "--sidecar", str(sidecar.path),
                              "--memory-budget", "1GB", "-p", PROMPT, "-n", "4", "-c", "256", "-v"],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PI2_CACHE_MAX": cache_max})
        assert res.returncode == 0, res.stderr[-2000:]
        return next(line for line in res.stdout.splitlines() if line.startswith("expert cache"))

    small = run("1MiB")  # two experts of ~0.4 MB for three routed layers of two experts a token each
    assert "a layer, fewer than the 2 experts a token routes to in each" in small, small
    assert "fewer than" not in run("64MiB"), "every expert fits"
