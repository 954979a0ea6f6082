"""The offline converter on a real model (SmolLM2-135M, 50% CATS sparsity): measured density, predictor
recall on held-out text, bundle round trip, both GGUF readers, and the errors of bad sidecars."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from pi2_gguf.assets import corpus
from pi2_gguf.converter import bundles, sparsity
from pi2_gguf.converter.convert import DENSE_PREDICTION, PACK_READ_SHARE, READ_GAP, bridged_read_share
from pi2_gguf.converter.model_ffn import ModelFfn, activation_values
from pi2_gguf.converter.predictor import Predictor, score_fn
from pi2_gguf.converter.profile import Profile
from pi2_gguf.errors import Pi2Error, SidecarError
from pi2_gguf.runtime import native
from pi2_gguf.sidecar import format as fmt
from pi2_gguf.sidecar import reader as sidecar
from pi2_gguf.sidecar.block_size import default_bundle_align

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from settings import SMOL_TARGET as TARGET  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_heldout_documents_are_not_training_documents() -> None:
    train, held = corpus.wiki().split()
    assert len(held) > 900 and len(train) > 8 * len(held)
    assert not set(train) & set(held)


def test_default_profile_size_follows_the_model_s_width_and_kind() -> None:
    """Dense models profile 2 training tokens per input dimension (2,048 to 8,192) and 1,024 held out; MoE models,
    whose experts each see a share of the tokens, 4 per dimension (4,096 to 8,192) and 2,048 (docs/CONVERT.md)."""
    from pi2_gguf.converter.profile import default_heldout_tokens, default_train_tokens

    assert [default_train_tokens(n) for n in (576, 1536, 2048, 4096, 8192)] == [2048, 3072, 4096, 8192, 8192]
    assert [default_train_tokens(n, moe=True) for n in (256, 1536, 2048, 2880)] == [4096, 6144, 8192, 8192]
    assert (default_heldout_tokens(), default_heldout_tokens(moe=True)) == (1024, 2048)


@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (300, 17), (1000, 33), (400, 1000)])
def test_quantile_threshold_is_numpy_s_linear_quantile(shape: tuple[int, ...]) -> None:
    """convert's thresholds partition the values (past 65,536 of them, those a sample brackets) instead of calling
    np.quantile (which sorts a copy); the value is np.quantile's exactly, at every share, ties included."""
    rng = np.random.default_rng(sum(shape))
    for values in (np.abs(rng.standard_normal(shape)).astype(np.float32),
                   rng.integers(0, 4, size=shape).astype(np.float32),  # ties
                   np.where(rng.random(shape) < 0.3, 0.0, rng.random(shape)).astype(np.float32)):  # a cut's zeros
        for q in (1e-6, 0.02, 0.1, 0.5, 0.9, 0.98, 1.0):
            assert sparsity._quantile_threshold(values, q) == float(np.quantile(values, q)), (shape, q)
    assert sparsity._quantile_threshold(np.ones(4, np.float32), 0.0) == 0.0  # every value passes


@pytest.mark.parametrize("criterion", ["product", "act"])
def test_density_on_heldout_is_within_5_points_of_target(smollm2: Path, smol_sidecar: Path, smol_cats_sidecar: Path,
                                                         smol_profile: Profile, criterion: str) -> None:
    """Recomputed here from the model's gate and up and the stored thresholds, not read from the sidecar.
    product: |act| admits 1 - target/5 of the neurons, |act * up| keeps the target share of all."""
    sc = sidecar.read(smol_sidecar if criterion == "product" else smol_cats_sidecar)
    assert sc.kv["pi2.sparsity.method"] == {"product": "product", "act": "cats"}[criterion]
    model = ModelFfn(smollm2)
    dens = []
    for il in range(model.n_layer):
        x = smol_profile.heldout[il]
        gate = model.layers[il]["gate"].dequantized()
        mag = sparsity.gate_magnitudes(model.activation, gate, x)
        admitted = mag > sc.kv["pi2.sparsity.thresholds"][il]
        active = admitted
        if criterion == "product":
            assert abs(admitted.mean() - sparsity.admit_density(TARGET)) <= 0.05, f"layer {il}: {admitted.mean():.3f}"
            product = np.abs(activation_values(model.activation, x @ gate.T) * (x @ model.layers[il]["up"].dequantized().T))
            active = admitted & (product > sc.kv["pi2.sparsity.product_thresholds"][il])
        d = float(active.mean())
        assert abs(d - (1 - TARGET)) <= 0.05, f"layer {il}: held-out density {d:.3f}"
        assert d == pytest.approx(sc.kv["pi2.sparsity.density"][il], abs=1e-6)
        dens.append(d)
    assert abs(np.mean(dens) - (1 - TARGET)) <= 0.02


def test_product_keeps_more_of_the_ffn_output_than_cats(smollm2: Path, smol_sidecar: Path, smol_cats_sidecar: Path,
                                                        smol_profile: Profile) -> None:
    """Why product is the default: at the same density its held-out FFN outputs are far closer to the
    dense ones (measured: middle layers 9-12% relative error against CATS's 22-33%)."""
    prod, cats = sidecar.read(smol_sidecar), sidecar.read(smol_cats_sidecar)
    model = ModelFfn(smollm2)
    for il in (5, 15, 25):
        x = smol_profile.heldout[il]
        L = model.layers[il]
        g = x @ L["gate"].dequantized().T
        a = activation_values(model.activation, g)
        h = a * (x @ L["up"].dequantized().T)
        down = L["down"].dequantized()
        y = h @ down.T
        keep_p = (np.abs(a) > prod.kv["pi2.sparsity.thresholds"][il]) & (np.abs(h) > prod.kv["pi2.sparsity.product_thresholds"][il])
        keep_c = np.abs(a) > cats.kv["pi2.sparsity.thresholds"][il]
        err = [float(np.linalg.norm((h * k) @ down.T - y) / np.linalg.norm(y)) for k in (keep_p, keep_c)]
        assert abs(keep_p.mean() - keep_c.mean()) < 0.03
        assert err[0] < 0.6 * err[1], (il, err)


@pytest.mark.parametrize("routed", [False, True], ids=["dense", "moe"])
def test_profile_file_round_trip(tmp_path: Path, routed: bool) -> None:
    """A profile written by save() (as `pi2-gguf profile` writes it) loads as it was, an MoE model's routing too (a
    routed profile's train_routes_i once counted as layers, and loading it failed); one of no layers is refused."""
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((20, 8)).astype(np.float16) for _ in range(3)]
    r = [rng.integers(0, 4, (20, 2)).astype(np.int16) for _ in range(3)] if routed else []
    prof = Profile("m.gguf", 123, "corpus", "sha", 8, x, x[::-1], r, r[::-1])
    back = Profile.load(prof.save(tmp_path / "p.npz"))
    assert (back.model_file, back.model_size, back.corpus, back.corpus_sha256, back.window) == \
        ("m.gguf", 123, "corpus", "sha", 8)
    for got, want in ((back.train, x), (back.heldout, x[::-1]), (back.train_routes, r), (back.heldout_routes, r[::-1])):
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    np.savez(tmp_path / "empty.npz", meta=np.array(["m.gguf", "1", "c", "s", "8"]))
    with pytest.raises(Pi2Error, match="holds no layers"):
        Profile.load(tmp_path / "empty.npz")


def test_predictor_recall_on_heldout_tokens(smollm2: Path, smol_sidecar: Path, smol_profile: Profile) -> None:
    """Predictors as decode holds them (the sidecar's F16, then W1 in Q8_0 and W2 in pi2.predictor.w2_type over the
    neurons in bundle-slot order) run on held-out tokens: recall >= 0.97 in every layer, and the recall and density
    the sidecar records are theirs."""
    sc = sidecar.read(smol_sidecar)
    assert sc.kv["pi2.sparsity.method"] == "product"
    model = ModelFfn(smollm2)
    score = score_fn("cats", lambda g: activation_values(model.activation, g))
    for il in range(model.n_layer):
        p = Predictor(sc.layer_tensor(il, "pi2_pred_w1").astype(np.float32),
                      sc.layer_tensor(il, "pi2_pred_b1").astype(np.float32).reshape(-1),
                      sc.layer_tensor(il, "pi2_pred_w2").astype(np.float32),
                      sc.layer_tensor(il, "pi2_pred_b2").astype(np.float32).reshape(-1),
                      sc.kv["pi2.predictor.cutoff"][il]).as_decoded(sc.layer_tensor(il, "pi2_order").reshape(-1),
                                                                    sc.kv["pi2.predictor.w2_type"])
        assert sc.kv["pi2.predictor.w2_type"] == "q4_0"  # convert's default
        assert p.rank == sc.kv["pi2.predictor.rank"][il]
        x = smol_profile.heldout[il]
        gate = model.layers[il]["gate"].dequantized()
        mag = sparsity.gate_magnitudes(model.activation, gate, x)
        # product: recall of the active neurons, those the threshold admits whose |act * up| passes too
        actual = sparsity.active(mag, sc.kv["pi2.sparsity.thresholds"][il],
                                 np.abs(activation_values(model.activation, x @ gate.T)
                                        * (x @ model.layers[il]["up"].dequantized().T)),
                                 sc.kv["pi2.sparsity.product_thresholds"][il])
        predicted = p.predict(x, score)
        recall = np.count_nonzero(predicted & actual) / np.count_nonzero(actual)
        assert recall >= 0.97, f"layer {il}: recall {recall:.4f}"
        assert recall == pytest.approx(sc.kv["pi2.predictor.recall"][il], abs=1e-4)
        assert np.mean(predicted) == pytest.approx(sc.kv["pi2.predictor.density"][il], abs=1e-4)


def test_recomputed_gate_matches_llamas_own(smollm2: Path) -> None:
    """Activations are recomputed from profiled FFN inputs; they must match what llama.cpp computed."""
    from pi2_gguf.runtime.runner import LlamaRunner

    seen: dict[tuple[int, str], np.ndarray] = {}
    with LlamaRunner(smollm2, n_ctx=64, watch=("ffn_norm", "ffn_gate"),
                     sink=lambda il, name, x: seen.__setitem__((il, name), x)) as r:
        r.decode(next(r.windows(corpus.wiki().split()[1], 64)))
    model = ModelFfn(smollm2)
    for il in (0, 14, 29):
        g_ours = seen[(il, "ffn_norm")] @ model.layers[il]["gate"].dequantized().T
        g_llama = seen[(il, "ffn_gate")]
        assert g_ours.shape == g_llama.shape == (64, 1536)
        rel = np.linalg.norm(g_ours - g_llama) / np.linalg.norm(g_llama)
        assert rel < 0.02, f"layer {il}: gate differs by {rel:.4f} (relative)"
        t = np.quantile(np.abs(activation_values("silu", g_llama)), TARGET)
        agree = np.mean((np.abs(activation_values("silu", g_ours)) > t) == (np.abs(activation_values("silu", g_llama)) > t))
        assert agree > 0.98


def test_bundles_round_trip(smollm2: Path, smol_sidecar: Path) -> None:
    sc = sidecar.read(smol_sidecar)
    model = ModelFfn(smollm2)
    for il in range(model.n_layer):
        ffn = model.layers[il]
        order = sc.layer_tensor(il, "pi2_order").reshape(-1)
        lay = sc.layout(il)
        raw = sc.bundles(il)
        assert lay.size % int(sc.kv["pi2.bundle.align"]) == 0 and raw.shape == (lay.n_bundles(1536), lay.size)
        b = sc.slots(il)
        gs, us, ds = sc.bundle_slices(il)
        assert np.array_equal(b[:, gs], ffn["gate"].raw[order]), f"layer {il}: gate rows differ"
        assert np.array_equal(b[:, us], ffn["up"].raw[order]), f"layer {il}: up rows differ"
        # everything but the neurons' parts is zero padding
        parts = np.zeros(raw.size, dtype=bool)
        for j in range(1536):
            parts[lay.offset(j):lay.offset(j) + lay.end] = True
        assert not raw.reshape(-1)[~parts].any()
        dtype = QT(sc.kv["pi2.bundle.down_type"][il])
        cols = bundles.dequantize_rows(dtype, b[:, ds], model.n_embd)
        want = ffn["down"].dequantized().T[order]
        err = bundles.rel_rmse(cols, want)
        assert err.max() <= sc.kv["pi2.bundle.down_tolerance"][il]
        assert err.max() == pytest.approx(sc.kv["pi2.bundle.down_error"][il], rel=1e-4)
        assert err.max() < 0.2  # 4-bit re-quantization of a 4-bit column: same order as Q4_1's own error


def test_bundle_type_requantizes_the_rows(smollm2: Path, smol_sidecar: Path, smol_q40_sidecar: Path) -> None:
    """--bundle-type q4_0 on the Q4_1 model: gate/up rows are ggml's Q4_0 quantization of the model's rows,
    down columns stay within Q4_0's own error, and a neuron takes fewer bytes than the model's own rows; the
    fingerprints are still the model's (the sidecar belongs to the same model file)."""
    sc, ref = sidecar.read(smol_q40_sidecar), sidecar.read(smol_sidecar)
    model = ModelFfn(smollm2)
    assert sc.kv["pi2.source.fingerprint"] == ref.kv["pi2.source.fingerprint"]
    for il in (0, model.n_layer // 2, model.n_layer - 1):
        ffn = model.layers[il]
        assert ffn["gate"].qtype == QT.Q4_1
        assert int(sc.kv["pi2.bundle.gate_type"][il]) == int(sc.kv["pi2.bundle.up_type"][il]) == int(QT.Q4_0)
        order = sc.layer_tensor(il, "pi2_order").reshape(-1)
        b = sc.slots(il)
        gs, us, ds = sc.bundle_slices(il)
        assert np.array_equal(b[:, gs], bundles.quantize_rows(QT.Q4_0, ffn["gate"].dequantized())[order])
        assert np.array_equal(b[:, us], bundles.quantize_rows(QT.Q4_0, ffn["up"].dequantized())[order])
        dtype = QT(sc.kv["pi2.bundle.down_type"][il])
        assert bundles.bits_per_weight(dtype) <= bundles.bits_per_weight(QT.Q4_0)
        cols = bundles.dequantize_rows(dtype, b[:, ds], model.n_embd)
        err = bundles.rel_rmse(cols, ffn["down"].dequantized().T[order])
        assert err.max() <= sc.kv["pi2.bundle.down_tolerance"][il]
        assert sc.layout(il).end < ref.layout(il).end  # fewer bytes per neuron


@pytest.mark.parametrize("name, says", [("q3_k", "blocks of 256 values, which do not divide"),
                                        ("iq2_xxs", "not one ggml quantizes without an importance matrix"),
                                        ("q5", "not a ggml type name")])
def test_bundle_type_that_cannot_be_stored_is_refused(smollm2: Path, tmp_path: Path, name: str, says: str) -> None:
    from pi2_gguf.converter.convert import convert

    with pytest.raises(Pi2Error, match=says):
        convert(smollm2, tmp_path / "x.pi2.gguf", bundle_type=name, progress=False)
    assert not (tmp_path / "x.pi2.gguf").exists()


def test_bundle_type_layers_take_the_type_alone(smollm2: Path, smol_profile: Profile, tmp_path: Path) -> None:
    """--bundle-type q4_0 --bundle-type-layers 0,5-6: those layers' rows are Q4_0, every other layer's are the
    model's own bytes (Q4_1) with down columns measured against the model's type."""
    from pi2_gguf.converter.convert import convert

    prof = smol_profile.save(tmp_path / "smol.npz")
    out = convert(smollm2, tmp_path / "mixed.pi2.gguf", sparsity=TARGET, profile=prof, ranks=[64], progress=False,
                  perplexity_budget=None, bundle_type="q4_0", bundle_type_layers="0,5-6").path
    sc, model = sidecar.read(out), ModelFfn(smollm2)
    gate_types = [int(t) for t in sc.kv["pi2.bundle.gate_type"]]
    assert [il for il, t in enumerate(gate_types) if t == int(QT.Q4_0)] == [0, 5, 6]
    assert all(t == int(QT.Q4_1) for il, t in enumerate(gate_types) if il not in (0, 5, 6))
    for il in (1, 5):
        ffn, order = model.layers[il], sc.layer_tensor(il, "pi2_order").reshape(-1)
        gs, _, _ = sc.bundle_slices(il)
        want = ffn["gate"].raw if il == 1 else bundles.quantize_rows(QT.Q4_0, ffn["gate"].dequantized())
        assert np.array_equal(sc.slots(il)[:, gs], want[order])
        own = bundles.down_columns(ffn["down"], None if il == 1 else QT.Q4_0)
        assert float(sc.kv["pi2.bundle.down_tolerance"][il]) == pytest.approx(own.tolerance)


@pytest.mark.parametrize("layers, says", [("4-2", "'4-2' runs backwards"),
                                          ("30", "'30' is not within the model's layers 0-29"),
                                          ("a-b", "'a-b' is not a layer or a range of layers")])
def test_bundle_type_layers_out_of_the_model_are_refused(smollm2: Path, tmp_path: Path, layers: str, says: str) -> None:
    from pi2_gguf.converter.convert import convert

    with pytest.raises(Pi2Error, match=says):
        convert(smollm2, tmp_path / "x.pi2.gguf", bundle_type="q4_0", bundle_type_layers=layers, progress=False)
    with pytest.raises(Pi2Error, match="--bundle-type-layers needs --bundle-type"):
        convert(smollm2, tmp_path / "x.pi2.gguf", bundle_type_layers="0-3", progress=False)
    assert not (tmp_path / "x.pi2.gguf").exists()


def test_down_type_sets_the_down_columns_error(smollm2: Path) -> None:
    """A down reference above the model's type (Q8_0 for SmolLM2's Q4_1) keeps the columns within Q8_0's own
    error, a fraction of what re-quantizing to Q4_1 costs, in a type of at least 8 bits."""
    down = ModelFfn(smollm2).layers[3]["down"]
    own, q8 = bundles.down_columns(down), bundles.down_columns(down, QT.Q8_0)
    assert own.qtype == QT.Q4_1 or bundles.bits_per_weight(own.qtype) <= bundles.bits_per_weight(QT.Q4_1)
    assert bundles.bits_per_weight(q8.qtype) >= 8.0
    assert q8.max_error <= q8.tolerance < own.max_error / 5
    cols = bundles.dequantize_rows(q8.qtype, q8.data, down.dequantized().shape[0])
    assert bundles.rel_rmse(cols, down.dequantized().T).max() == pytest.approx(q8.max_error, rel=1e-6)


def test_down_type_that_cannot_be_stored_is_refused(smollm2: Path, tmp_path: Path) -> None:
    from pi2_gguf.converter.convert import convert

    with pytest.raises(Pi2Error, match="--down-type: bundle type q6_k has blocks of 256 values"):
        convert(smollm2, tmp_path / "x.pi2.gguf", down_type="q6_k", progress=False)
    assert not (tmp_path / "x.pi2.gguf").exists()


def test_bundles_hold_several_neurons_where_every_neuron_is_read(smol_sidecar: Path) -> None:
    """Layers a token reads (nearly) whole under a budget, wanted or bridged (all of SmolLM2's at 50% product,
    whose predictors select most neurons), pack several neurons to a bundle, all in bundles of one size; the
    others one neuron per bundle."""
    sc = sidecar.read(smol_sidecar)
    types = [tuple(int(sc.kv[f"pi2.bundle.{m}_type"][il]) for m in ("gate", "up", "down")) for il in range(sc.n_layer)]
    align = int(sc.kv["pi2.bundle.align"])
    packed = [il for il in range(sc.n_layer)
              if bridged_read_share(float(sc.kv["pi2.predictor.density"][il]),
                                    fmt.bundle_layout(*types[il], 576, align, 1).size) >= PACK_READ_SHARE]
    assert len(packed) > sc.n_layer // 2
    assert [sc.layout(il) for il in packed] == fmt.packed_bundle_layouts([types[il] for il in packed], 576, align)
    assert len({sc.layout(il).size for il in packed}) == 1
    for il in range(sc.n_layer):
        lay = sc.layout(il)
        if il in packed:  # less padding per neuron than a bundle each
            assert lay.neurons > 1 and lay.size / lay.neurons < fmt.bundle_layout(*types[il], 576, align, 1).size
        else:
            assert lay.neurons == 1


def _bridged_read_share_simulated(p: float, bundle_bytes: int, n: int = 200_000, seed: int = 0) -> float:
    """The reader's rule run on random wanted sets: a run of unwanted bundles between two wanted ones is read
    with them when it spans at most READ_GAP bytes."""
    wanted = np.flatnonzero(np.random.default_rng(seed).random(n) < p)
    runs = np.diff(wanted) - 1
    bridged = runs[(runs > 0) & (runs * bundle_bytes <= READ_GAP)].sum()
    return (len(wanted) + bridged) / n


@pytest.mark.parametrize("p, bundle_bytes", [(0.39, 2048), (0.254, 3584), (0.374, 2560), (0.14, 3584), (0.05, 3584),
                                             (0.5, 40960)])
def test_bridged_read_share_is_the_readers_rule(p: float, bundle_bytes: int) -> None:
    """The share convert packs by is what the reader's gap bridging reads of one-neuron bundles: within 0.01 of
    the rule run on 200,000 random neurons (SmallThinker-shaped 0.39 of 2 KiB bundles: 99.9%, the dReLU 1.5B's
    0.254 of 3.5 KiB: 82%, a 40 KiB bundle, past the gap: p)."""
    assert bridged_read_share(p, bundle_bytes) == pytest.approx(_bridged_read_share_simulated(p, bundle_bytes), abs=0.01)


def test_pack_threshold_separates_the_measured_models() -> None:
    """SmallThinker-shaped experts (0.39 of 2 KiB bundles) pack; the dReLU 1.5B (0.254 of 3.5 KiB) does not."""
    assert bridged_read_share(0.39, 2048) >= PACK_READ_SHARE > bridged_read_share(0.254, 3584)


def test_read_gap_is_the_plugins_default() -> None:
    """convert packs by the plugin's default PI2_IO_GAP: the plugin's table (config.c) and docs/SETTINGS.md."""
    row = next(line for line in (ROOT / "docs" / "SETTINGS.md").read_text().splitlines() if line.startswith("| `PI2_IO_GAP`"))
    assert int(row.split("|")[4].strip()) == READ_GAP
    decl = next(line for line in (ROOT / "ggml-backend" / "src" / "core" / "config.c").read_text().splitlines()
                if '"PI2_IO_GAP"' in line)
    assert int(decl.split(",")[4].strip()) == READ_GAP


def test_packed_bundle_layouts() -> None:
    q4k, q6k, f16 = int(QT.Q4_K), int(QT.Q6_K), int(QT.F16)
    # one type alone: the count that pads least. Qwen2.5-1.5B's Q4_K neuron, 3 x 864 bytes: 16 fill 41,472
    # bytes (81 x 512) exactly
    (lay,) = fmt.packed_bundle_layouts([(q4k, q4k, q4k)], 1536, 512)
    assert (lay.neurons, lay.stride, lay.size, lay.offset(17)) == (16, 2592, 41472, 41472 + 2592)
    # its layers with Q6_K down columns (3,008 bytes a neuron) as well: one size for both, 14 and 12 neurons
    # in 36,352 bytes, 0.5% padding (16 and 8 in 41,472 and 24,064 bytes would each pad least alone)
    lays = fmt.packed_bundle_layouts([(q4k, q4k, q4k), (q4k, q4k, q6k), (q4k, q4k, q4k)], 1536, 512)
    assert [(x.neurons, x.stride, x.size) for x in lays] == [(14, 2592, 36352), (12, 3008, 36352), (14, 2592, 36352)]
    assert sum(x.size / x.neurons - x.stride for x in lays) / sum(x.stride for x in lays) < 0.006
    assert lays[1].offset(13) == 36352 + 3008
    # one neuron of 3 x 4096 bytes fits 4 KiB pages exactly: no reason to pack
    assert fmt.packed_bundle_layouts([(f16, f16, f16)], 2048, 4096)[0].neurons == 1
    with pytest.raises(ValueError, match="does not hold its 14 x 2592 bytes"):
        fmt.bundle_layout(q4k, q4k, q4k, 1536, 512, 14, 35840)


def test_default_bundle_align_is_the_output_devices_block_size(smol_sidecar: Path) -> None:
    """convert without --bundle-align pads bundles to the logical block size of the device it writes to
    (sysfs), 4096 where there is no block device (tmpfs)."""
    sc = sidecar.read(smol_sidecar)
    dev = os.stat(smol_sidecar).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queue = sysfs / "queue" if (sysfs / "queue").exists() else sysfs.parent / "queue"
    want = int((queue / "logical_block_size").read_text()) if queue.exists() else 4096
    assert int(sc.kv["pi2.bundle.align"]) == (want if want in fmt.BUNDLE_ALIGNS else 4096)
    assert default_bundle_align(Path("/dev/shm/x.pi2.gguf"))[0] == 4096


def test_bundles_are_4k_aligned_in_the_file(smol_sidecar: Path) -> None:
    r = GGUFReader(smol_sidecar)
    offsets = [int(t.data_offset) for t in r.tensors if t.name.endswith("pi2_bundles")]
    assert len(offsets) == 30 and all(o % 4096 == 0 for o in offsets)


def test_ranking_and_hot_counts(smol_sidecar: Path) -> None:
    sc = sidecar.read(smol_sidecar)
    for il in range(sc.n_layer):
        freq = sc.layer_tensor(il, "pi2_freq").reshape(-1)
        ranked = freq[sc.layer_tensor(il, "pi2_order").reshape(-1)]
        assert np.all(np.diff(ranked) <= 0)
        k = sc.kv["pi2.hot_count"][il]
        assert ranked[:k].sum() >= 0.5 * freq.sum() > ranked[:k - 1].sum()
        # training density of the neurons whose gate passes the threshold: what a token reads
        assert freq.mean() == pytest.approx(sparsity.admit_density(TARGET), abs=0.02)


def test_sidecar_loads_with_ggml_gguf_reader(smol_sidecar: Path, smollm2: Path) -> None:
    native.validate_sidecar_c(smol_sidecar)
    n_layer, fp = native.sidecar_summary_c(smol_sidecar)
    assert n_layer == 30
    assert fp == ModelFfn(smollm2).fingerprint() == sidecar.read(smol_sidecar).kv["pi2.source.fingerprint"]


def test_sidecar_for_another_model_is_refused(smol_sidecar: Path, gemma3: Path) -> None:
    gate = ModelFfn(gemma3).layers[0]["gate"]
    with pytest.raises(SidecarError, match="another model"):
        native.check_sidecar_weight_c(smol_sidecar, 0, 0, int(gate.qtype), gate.ne0, gate.ne1, gate.data)


def test_truncated_sidecar_is_refused(smol_sidecar: Path, tmp_path: Path) -> None:
    size = smol_sidecar.stat().st_size
    for cut in (size - 4096, size // 2, 2000):
        bad = tmp_path / f"cut{cut}.pi2.gguf"
        with smol_sidecar.open("rb") as f:
            bad.write_bytes(f.read(cut))
        with pytest.raises(SidecarError, match="truncated|corrupt"):
            sidecar.read(bad)
        with pytest.raises(SidecarError):
            native.validate_sidecar_c(bad)


def test_wrong_format_version_is_refused(smol_sidecar: Path, tmp_path: Path) -> None:
    head = bytearray(smol_sidecar.read_bytes()[:1 << 20])
    key = b"pi2.format_version"
    at = head.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    # GGUF type UINT32, this converter's version; the file claims the next one
    assert struct.unpack_from("<II", head, at) == (4, fmt.FORMAT_VERSION)
    other = fmt.FORMAT_VERSION + 1
    struct.pack_into("<I", head, at + 4, other)
    bad = tmp_path / f"v{other}.pi2.gguf"
    with smol_sidecar.open("rb") as f:
        bad.write_bytes(bytes(head) + f.read()[len(head):])
    with pytest.raises(SidecarError, match=f"format version {other}"):
        sidecar.read(bad)
    with pytest.raises(SidecarError, match="version"):
        native.validate_sidecar_c(bad)


def test_down_columns_of_k_quant_model_fall_back_to_a_type_that_fits(gemma3: Path) -> None:
    """Gemma-3's ffn_down is Q6_K; n_embd 640 is no multiple of 256, so the reference is Q8_0."""
    down = ModelFfn(gemma3).layers[0]["down"]
    assert down.qtype == QT.Q6_K
    d = bundles.down_columns(down)
    assert bundles.reference_type(QT.Q6_K, 640) == QT.Q8_0
    err = bundles.rel_rmse(bundles.dequantize_rows(d.qtype, d.data, 640), down.dequantized().T)
    assert err.max() <= d.tolerance < 0.02


def test_sparsity_plan_rules() -> None:
    assert sparsity.SparsityPlan.for_activation("relu", None, None).method == "relu"
    with pytest.raises(ValueError, match="exactly sparse"):
        sparsity.SparsityPlan.for_activation("relu", 0.5, None)
    with pytest.raises(ValueError, match="sparsity must be"):
        sparsity.SparsityPlan.for_activation("silu", 1.5, None)
    assert sparsity.SparsityPlan.for_activation("silu", None, 0.3).threshold == 0.3
    assert sparsity.SparsityPlan.for_activation("gelu", None, None).target == sparsity.DEFAULT_SPARSITY
    assert sparsity.SparsityPlan.for_activation("silu", None, None).method == "product"
    assert sparsity.SparsityPlan.for_activation("silu", 0.7, None, "act").method == "cats"
    assert sparsity.SparsityPlan.for_activation("silu", None, 0.3).method == "cats"
    with pytest.raises(ValueError, match="needs criterion act"):
        sparsity.SparsityPlan.for_activation("silu", None, 0.3, "product")
    with pytest.raises(ValueError, match="criterion must be"):
        sparsity.SparsityPlan.for_activation("silu", 0.5, None, "gate")
    with pytest.raises(ValueError, match="exactly sparse"):
        sparsity.SparsityPlan.for_activation("relu", None, None, "act")
    # admission: at least the active share, 0.9 at 50% and 0.25 at 90%
    for s in (0.0, 0.2, 0.5, 0.7, 0.9, 0.99):
        assert 1 - s <= sparsity.admit_density(s) <= 1
    assert sparsity.admit_density(0.5) == pytest.approx(0.9) and sparsity.admit_density(0.9) == pytest.approx(0.25)
    assert sparsity.hot_count(np.array([0.9, 0.05, 0.03, 0.02])) == 1
    assert sparsity.hot_count(np.full(10, 0.5)) == 5


def test_convert_cli_writes_beside_the_model_and_leaves_it_untouched(smollm2: Path, tmp_path: Path) -> None:
    model = tmp_path / smollm2.name
    shutil.copyfile(smollm2, model)
    before = hashlib.sha256(model.read_bytes()).hexdigest()
    cli = [sys.executable, "-m", "pi2_gguf.cli"]
    res = subprocess.run([*cli, "convert", str(model), "--train-tokens", "512", "--heldout-tokens", "128",
                          "--ranks", "32", "--epochs", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / smollm2.name.replace(".gguf", fmt.SUFFIX)
    assert out.is_file() and "wrote" in res.stdout
    assert "30 layers" in res.stdout and "held-out recall" in res.stdout  # the inspect table of the file written
    assert hashlib.sha256(model.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([model.name, out.name])  # no temp files left
    png = tmp_path / "hot.png"
    res = subprocess.run([*cli, "inspect", str(out), "--png", str(png)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "30 layers" in res.stdout and "held-out recall" in res.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert w == 1000 and h > 400  # 10 x (1.5 + 0.12 per layer) inches at 100 dpi
    # without matplotlib: an error naming the extra, no traceback
    code = "import sys; sys.modules['matplotlib'] = None; from pi2_gguf.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "inspect", str(out), "--png", str(tmp_path / "no.png")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "pip install 'pi2-gguf[plot]'" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "no.png").exists()
    # bad input through the CLI: clear errors, exit code 2
    res = subprocess.run([*cli, "inspect", str(model)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "not a pi2 sidecar" in res.stderr
    res = subprocess.run([*cli, "convert", str(model), "--sparsity", "1.2"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "sparsity must be in [0, 1)" in res.stderr


def test_training_free_predictor_is_the_best_rank_k_fit_and_reaches_its_recall(smollm2: Path,
                                                                            smol_profile: Profile) -> None:
    """--predictor svd: z = the least-squares rank-k fit of g on the profiled x (checked against an SVD of
    the fitted g itself), and its calibrated cutoff catches the recall target on held-out tokens."""
    from pi2_gguf.converter import predictor as pm

    model = ModelFfn(smollm2)
    il = 5
    gate = model.layers[il]["gate"].dequantized()
    x, xh = smol_profile.train[il].astype(np.float32), smol_profile.heldout[il].astype(np.float32)
    g = x @ gate.T
    k = 16
    z = pm.rrr_init(x, gate, 2 * k).outputs(x)
    # the best rank-k approximation of g in the column space of x: g's own truncated SVD (g = x W^T already
    # lies in it)
    u, s, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    best = (u[:, :k] * s[:k]) @ vt[:k]
    assert np.linalg.norm(z - best) <= 1e-3 * np.linalg.norm(g)
    act = lambda v: activation_values(model.activation, v)  # noqa: E731
    score = pm.score_fn("cats", act)
    th = float(np.quantile(np.abs(act(g)), 0.5))
    costs = pm.Costs(300.0)
    fitted = pm.fit_layer(score, th, gate, x, g, xh, xh @ gate.T, [64], 0.99, costs, kind="svd")
    assert fitted.heldout.recall >= 0.97 and fitted.predictor.rank == 64


def test_decoded_directions_give_each_width_s_predictor_as_decode_holds_it(smollm2: Path,
                                                                          smol_profile: Profile) -> None:
    """The widths' training-free predictors built from directions rounded once (DecodedDirections) are the ones
    rrr_init and as_decoded make width by width: the same rounded weights, and the same validation outputs up to the
    order of float sums; widths whose W1 rows round to F16 (rank 36: no multiple of 32) and to Q8_0 alike, tried
    narrowest first and then one narrower again."""
    from pi2_gguf.converter import predictor as pm

    model = ModelFfn(smollm2)
    il = 7
    gate = model.layers[il]["gate"].dequantized()
    x = smol_profile.train[il].astype(np.float32)
    x_fit, x_val = x[:-256], x[-256:]
    basis = pm.rrr_basis(x_fit, gate, 144)
    order = np.random.default_rng(0).permutation(gate.shape[0]).astype(np.int32)
    dirs = pm.DecodedDirections(basis, gate, x_val, order, "q4_0", None)
    for rank in (36, 64, 96, 288, 64):
        got, z = dirs.predictor(rank)
        want = pm.rrr_init(x_fit, gate, rank, basis).as_decoded(order, "q4_0")
        for a, b in ((got.w1, want.w1), (got.b1, want.b1), (got.w2, want.w2), (got.b2, want.b2)):
            assert a.shape == b.shape and np.array_equal(a, b), rank
        ref = want.outputs(x_val)
        assert np.abs(z - ref).max() <= 1e-5 * np.abs(ref).max(), rank


def test_default_target_follows_the_perplexity_budget(smollm2: Path, smol_profile: Profile, tmp_path: Path) -> None:
    """Without --sparsity convert writes the default target, measures held-out perplexity as decode computes it
    (predicted mode under a budget) and chooses within the budget: where every layer's predictor reads every
    bundle the lowest target (the same bytes), else the first target within it; where none holds, down columns
    against Q8_0. The sidecar records both perplexities and the choice, and the recorded perplexity is what the
    perplexity tool measures for that file. SmolLM2 (n_embd 576: no Q3_K rows) lands within +3%."""
    from pi2_gguf.bench.perplexity import perplexity
    from pi2_gguf.converter.convert import HIGHER_DOWN_TYPE, QUALITY_CHUNKS, QUALITY_CTX, TARGET_STEPS, convert
    from pi2_gguf.converter.options import DEFAULT_OUTPUT_ROWS

    prof = smol_profile.save(tmp_path / "smol.npz")
    res = convert(smollm2, tmp_path / "b.pi2.gguf", profile=prof, ranks=[64], progress=False, perplexity_budget=0.03)
    kv = sidecar.read(res.path).kv
    dense, ppl, target = kv["pi2.quality.perplexity_dense"], kv["pi2.quality.perplexity"], kv["pi2.sparsity.target"]
    choice = kv["pi2.quality.choice"]
    assert kv["pi2.quality.budget"] == pytest.approx(0.03)
    assert dense < ppl <= dense * 1.03, res.notes
    tried = [sparsity.DEFAULT_SPARSITY, *TARGET_STEPS]
    assert target == pytest.approx(tried[[round(t, 2) for t in tried].index(round(target, 2))])
    assert choice.startswith(f"sparsity {target:.2f}")
    if all(d >= DENSE_PREDICTION for d in kv["pi2.predictor.density"]):
        assert target == pytest.approx(TARGET_STEPS[-1]) and "every layer's predictor" in choice
    if target < sparsity.DEFAULT_SPARSITY:
        assert any(f"sparsity {target:.2f} chosen" in n or "no sparsity target" in n for n in res.notes), res.notes
    # SmolLM2's tied Q8_0 table: output rows by default, scored with every candidate, and its Q4_0 copy stored
    assert kv["pi2.budget.output_rows"] == DEFAULT_OUTPUT_ROWS and "(the tied token embedding)" in choice
    copy = sidecar.read(res.path).tensors[fmt.OUTPUT_COPY_TENSOR]
    assert copy.tensor_type == QT.Q4_0 and [int(x) for x in copy.shape] == [576, 49152]
    if "down columns against Q8_0" in choice:  # the columns keep Q8_0's error, a fifth of Q4_1's or less
        assert any(f"measured against {HIGHER_DOWN_TYPE.name}" in n for n in res.notes)
        assert max(kv["pi2.bundle.down_error"]) < 0.03
    # its down matrices are stored as its gate and up (Q4_1): no lower down columns to try, even where convert
    # raised them to Q8_0's error
    assert not any("rows' type" in n for n in res.notes), res.notes
    text = "\n\n".join(corpus.load(None).split()[1])
    # what a memory budget decodes from the sidecar's bundles (a budget the whole FFN fits in would read SmolLM2's layers
    # whole from the model file: PI2_DENSE_READS=bundles, as convert scores)
    again = perplexity(smollm2, text, QUALITY_CTX, QUALITY_CHUNKS, progress=False, sidecar=res.path, mode="predicted",
                       memory_budget=2_000_000_000, chunk_batches=True, settings={"dense_reads": "bundles"})
    assert again.ppl == pytest.approx(ppl, rel=1e-5)


def _same_layer(a: object, b: object) -> None:
    """Two LayerData alike field by field (arrays exactly)."""
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("criterion", ["product", "act"])
def test_one_pass_plans_each_target_as_a_pass_of_its_own(smollm2: Path, smol_profile: Profile, criterion: str) -> None:
    """_plan_layers makes several targets in one pass, sharing each layer's gate and up values and its predictors'
    basis and outputs: every target's layers equal the ones a pass for that target alone makes (two layers planned,
    the others left to the model file as a routed expert read whole would be)."""
    from pi2_gguf.converter import convert as cm

    model = ModelFfn(smollm2)
    skip = frozenset(range(model.n_layer)) - {3, 17}
    plans = [sparsity.SparsityPlan.for_activation(model.activation, t, None, criterion) for t in (0.5, 0.1)]

    def plan(ps: list[sparsity.SparsityPlan]) -> list[object]:
        return cm._plan_layers(model, smol_profile, ps, [32, 64], 0.99, 0, "svd", {}, {}, None, None, None, False,
                               skip)

    joint = plan(plans)
    for k, p in enumerate(plans):
        alone = plan([p])[0]
        for il in (3, 17):
            _same_layer(joint[k].layers[il], alone.layers[il])
    assert joint[0].layers[3].threshold != joint[1].layers[3].threshold  # two targets, not one twice


def test_layers_planned_side_by_side_equal_layers_planned_one_at_a_time(smollm2: Path, smol_profile: Profile,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers planned at once, numpy's BLAS on one thread each, make the plans one layer at a time makes, each in
    its place (three layers planned, the others left to the model file)."""
    from pi2_gguf.converter import convert as cm

    model = ModelFfn(smollm2)
    skip = frozenset(range(model.n_layer)) - {2, 9, 20}
    plan = sparsity.SparsityPlan.for_activation(model.activation, 0.5, None, "product")

    def planned(workers: int) -> object:
        monkeypatch.setattr(cm, "_plan_workers", lambda *_: workers)
        return cm._plan_layers(model, smol_profile, [plan], [32, 64], 0.99, 0, "svd", {}, {}, None, None, None, False,
                               skip)[0]

    one, two = planned(1), planned(2)
    for il in (2, 9, 20):
        _same_layer(one.layers[il], two.layers[il])
    assert one.layers[2].threshold != one.layers[9].threshold  # three layers of their own, in their places
    assert cm._plan_workers(model, smol_profile, 3) == (2 if (os.cpu_count() or 1) >= 2 else 1)


def test_down_columns_swapped_keep_the_plan_a_pass_against_them_makes(smollm2: Path, smol_profile: Profile) -> None:
    """convert's Q8_0 lever re-quantizes a plan's down columns (_with_downs) instead of planning again: the layers
    equal those of a pass whose down columns are measured against Q8_0 (a predictor's width does not depend on the
    down columns' bytes)."""
    from pi2_gguf.converter import convert as cm

    model = ModelFfn(smollm2)
    skip = frozenset(range(model.n_layer)) - {5}
    plan = sparsity.SparsityPlan.for_activation(model.activation, 0.3, None, "product")

    def planned(down: QT | None) -> object:
        return cm._plan_layers(model, smol_profile, [plan], [32, 64, 128], 0.99, 0, "svd", {}, {}, None, down, None,
                               False, skip)[0]

    swapped = cm._with_downs(model, planned(None), {5: QT.Q8_0})
    direct = planned(QT.Q8_0)
    _same_layer(swapped.layers[5], direct.layers[5])
    assert swapped.types[5] == direct.types[5] and QT(swapped.types[5][2]) == QT.Q8_0
    np.testing.assert_array_equal(swapped.downs[5].data, direct.downs[5].data)


@pytest.mark.parametrize("table, pays", [(None, True), (QT.Q8_0, True), (QT.Q4_K, False)])
def test_tied_embedding_gets_output_rows_where_its_copy_pays(relu_model: tuple[Path, Path, list], tmp_path: Path,
                                                              table: QT | None, pays: bool) -> None:
    """A tied token embedding (the synthetic model has no output.weight) gets output rows by default where its
    in-RAM copy takes at most TIED_COPY_SHARE of the table: its F32 and Q8_0 tables (Q3_K copies of 0.11 and 0.40),
    not a Q4_K one (a Q3_K copy of 0.76). A model's own output matrix gets them whatever its type."""
    from gguf_copy import copy_gguf

    from pi2_gguf.converter.convert import TIED_COPY_SHARE, _OutputCopies
    from pi2_gguf.runtime import native

    model = relu_model[0]
    if table is not None:
        model = copy_gguf(model, tmp_path / "t.gguf", quantize=lambda name: table if name == "token_embd.weight" else None)
    m = ModelFfn(model)
    assert not m.has_output
    got = native.output_copy_size(model, False)
    assert got is not None and (got[1] <= TIED_COPY_SHARE * m.output_bytes) == pays
    made = native.output_copy(model, False)  # the size query names the copy a load (and convert) makes
    assert made is not None and (made[0], made[1].nbytes) == got
    assert _OutputCopies(model).rows_pay(m) == pays
    untied = copy_gguf(model, tmp_path / "u.gguf",
                       extra=lambda name, data: [("output.weight", data)] if name == "token_embd.weight" else [])
    assert _OutputCopies(untied).rows_pay(ModelFfn(untied))


def test_copy_lever_only_where_q2_k_makes_another_copy(relu_model: tuple[Path, Path, list], smollm2: Path) -> None:
    """PI2_OUTPUT_COPY=q2_k is a lever convert measures only where it changes the copy: rows of whole 256-value
    blocks (the synthetic model's 256: Q2_K against Q3_K), not SmolLM2's 576 (Q4_0 either way)."""
    from pi2_gguf.converter.convert import _OutputCopies

    assert _OutputCopies(relu_model[0]).small_differs()
    assert not _OutputCopies(smollm2).small_differs()


@pytest.fixture(scope="module")
def mixed_silu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic SiLU model laid out as Q4_K_M lays out Qwen2.5: Q4_K gate and up rows, Q6_K down, and an output
    matrix of its own (Q6_K, a copy of the token embedding)."""
    from gguf_copy import copy_gguf

    from pi2_gguf.converter import synthetic
    from settings import RELU_SHAPE

    d = tmp_path_factory.mktemp("mixed")
    f32 = d / "silu.gguf"
    synthetic.make(f32, RELU_SHAPE, synthetic.Sparsity(density=0.5), "silu", QT.F32, calib_tokens=256,
                   heldout_tokens=128, progress=False)
    types = {"ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K, "output.weight": QT.Q6_K}
    out = copy_gguf(f32, d / "mixed.gguf",
                    extra=lambda name, data: [("output.weight", data)] if name == "token_embd.weight" else [],
                    quantize=lambda name: next((q for suffix, q in types.items() if name.endswith(suffix)), None))
    return out


def test_budget_levers_are_measured_and_kept_within_the_budget(mixed_silu: Path, tmp_path: Path) -> None:
    """With the default target and a budget that holds it, convert then measures the output matrix's copy in Q2_K
    with 1,024 exact rows and the down columns at the rows' type (Q6_K downs at Q4_K) together, and keeps both within
    the budget: the sidecar records both, and its recorded perplexity is the one measured with both."""
    from pi2_gguf.converter.convert import SMALL_OUTPUT_COPY, convert

    res = convert(mixed_silu, tmp_path / "m.pi2.gguf", train_tokens=1024, heldout_tokens=256, progress=False,
                  perplexity_budget=100.0)  # +10,000%: a random model's perplexity moves a lot
    kv = sidecar.read(res.path).kv
    assert kv["pi2.budget.output_copy"] == SMALL_OUTPUT_COPY[0] and kv["pi2.budget.output_rows"] == SMALL_OUTPUT_COPY[1]
    assert all(bundles.bits_per_weight(QT(t)) <= bundles.bits_per_weight(QT.Q4_K) for t in kv["pi2.bundle.down_type"])
    n_layer = len(kv["pi2.n_ff"])
    assert f"down columns at the gate/up rows' type in {n_layer} layers" in kv["pi2.quality.choice"]
    assert "the rest from a Q2_K copy" in kv["pi2.quality.choice"]
    assert sum("kept" in n for n in res.notes) == 1 and any("together" in n and "both kept" in n for n in res.notes), \
        res.notes


def _expected_at_scores(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, set[str]]]:
    """(the perplexity step, the steps the time left counts then) at each score convert begins."""
    from pi2_gguf.converter import eta

    seen: list[tuple[str, set[str]]] = []
    begin = eta.Progress.begin

    def spy(self: eta.Progress, step: str, label: str | None) -> None:
        if step.startswith("perplexity"):
            seen.append((step, set(self.steps)))
        begin(self, step, label)

    monkeypatch.setattr(eta.Progress, "begin", spy)
    return seen


def test_budget_levers_beyond_the_budget_are_dropped(mixed_silu: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same choice with the measurements scripted (dense 10.0; both levers together on the first target 10.6, the
    target alone 10.1, then alone the Q2_K copy 10.5 and the lowered down columns 10.2; budget +3%): together they
    miss the budget, so the target is scored and each lever alone; the copy is beyond the budget and dropped (Q3_K
    with 64 rows stays recorded as before), the down columns are kept, and the sidecar records 10.2."""
    from pi2_gguf.converter import convert as convert_mod

    measured = iter([10.0, 10.6, 10.1, 10.5, 10.2])
    monkeypatch.setattr(convert_mod, "_perplexity", lambda *a, **k: next(measured))
    seen = _expected_at_scores(monkeypatch)
    res = convert_mod.convert(mixed_silu, tmp_path / "m.pi2.gguf", train_tokens=1024, heldout_tokens=256,
                              progress=False, perplexity_budget=0.03)
    # the time left counts the target alone only once the levers together miss, then counts it (and times it)
    target = next(step for step, _ in seen if step.startswith("perplexity sparsity"))
    assert [target in steps for step, steps in seen] == [False, False, True, True, True], seen
    kv = sidecar.read(res.path).kv
    assert "pi2.budget.output_copy" not in kv and kv["pi2.budget.output_rows"] == convert_mod.DEFAULT_OUTPUT_ROWS
    assert all(bundles.bits_per_weight(QT(t)) <= bundles.bits_per_weight(QT.Q4_K) for t in kv["pi2.bundle.down_type"])
    assert kv["pi2.quality.perplexity"] == pytest.approx(10.2)
    assert any("together: +6.0%, beyond the budget; each measured alone" in n for n in res.notes), res.notes
    assert any("Q2_K with 1024 exact rows: +5.0%, beyond the budget" in n for n in res.notes), res.notes
    assert next(measured, None) is None  # dense, both levers, the target, and one candidate per lever


def test_budget_levers_held_together_spare_the_target_alone(mixed_silu: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted (dense 10.0, both levers together on the first target 10.2; budget +3%): they hold, so the target
    without them is not scored (it takes no precision they take): two held-out runs instead of three, the sidecar
    with both levers and 10.2 recorded."""
    from pi2_gguf.converter import convert as convert_mod
    from pi2_gguf.converter.convert import SMALL_OUTPUT_COPY

    measured = iter([10.0, 10.2])
    monkeypatch.setattr(convert_mod, "_perplexity", lambda *a, **k: next(measured))
    seen = _expected_at_scores(monkeypatch)
    res = convert_mod.convert(mixed_silu, tmp_path / "m.pi2.gguf", train_tokens=1024, heldout_tokens=256,
                              progress=False, perplexity_budget=0.03)
    kv = sidecar.read(res.path).kv
    assert kv["pi2.budget.output_copy"] == SMALL_OUTPUT_COPY[0] and kv["pi2.budget.output_rows"] == SMALL_OUTPUT_COPY[1]
    assert all(bundles.bits_per_weight(QT(t)) <= bundles.bits_per_weight(QT.Q4_K) for t in kv["pi2.bundle.down_type"])
    assert kv["pi2.quality.perplexity"] == pytest.approx(10.2)
    assert f"down columns at the gate/up rows' type in {len(kv['pi2.n_ff'])} layers (+2.0% with the output copy)" \
        in kv["pi2.quality.choice"]
    assert any("together: +2.0%, within the budget, both kept (the target without them was not scored" in n
               for n in res.notes), res.notes
    assert next(measured, None) is None
    # nor did the time left count it: the dense score and the levers' were all it expected of the scores
    assert [step for step, _ in seen] == ["perplexity dense", "perplexity output copy and downs at the rows' type"]
    assert all({st for st in steps if st.startswith("perplexity")} == {step for step, _ in seen} for _, steps in seen), seen


def test_explicit_target_is_kept_and_measured(smol_sidecar: Path) -> None:
    """A target given (the suite's SmolLM2 sidecar: --sparsity 0.5) is kept; its perplexity is still recorded."""
    kv = sidecar.read(smol_sidecar).kv
    assert kv["pi2.sparsity.target"] == pytest.approx(0.5)
    assert kv["pi2.quality.perplexity"] > kv["pi2.quality.perplexity_dense"] > 1.0


def test_f32_keys_past_f32_range_are_written_as_inf(tmp_path: Path) -> None:
    # a random model's perplexity can be exp(100) (the 1.5B dReLU model of tools/make_model.py): convert used to
    # die in GGUFWriter's struct.pack after measuring it; the file holds f32, so it records +inf
    from gguf import GGUFWriter

    from pi2_gguf.sidecar import writer

    path = tmp_path / "keys.gguf"
    w = GGUFWriter(str(path), "pi2")
    writer._ADD[fmt.KT.F32](w, "pi2.quality.perplexity_dense", 2.7e43)
    writer._ADD[fmt.KT.F32](w, "pi2.quality.perplexity", 9.5)
    writer._ADD[fmt.KT.F32_ARR](w, "pi2.test.values", [1e39, -1e39, 0.25])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    fields = GGUFReader(path).fields
    assert float(fields["pi2.quality.perplexity_dense"].parts[-1][0]) == np.inf
    assert float(fields["pi2.quality.perplexity"].parts[-1][0]) == pytest.approx(9.5)
    f = fields["pi2.test.values"]
    assert [float(f.parts[i][0]) for i in f.data] == [np.inf, -np.inf, 0.25]


def test_expert_reads_auto_follows_the_experts_activation() -> None:
    """convert's default --expert-reads auto: neuron bundles for ReLU-family experts (reads of the neurons that fire
    pay for the copy), whole reads from the model file for every other activation (their bundles would hold nearly
    every neuron); an explicit choice is kept whatever the activation."""
    from pi2_gguf.converter.options import DEFAULT_EXPERT_READS, expert_reads_for
    from pi2_gguf.sidecar import format as fmt

    assert DEFAULT_EXPERT_READS == "auto"
    assert [expert_reads_for("auto", a) for a in fmt.RELU_FAMILY] == ["bundles"] * len(fmt.RELU_FAMILY)
    assert [expert_reads_for("auto", a) for a in ("silu", "gelu", "swiglu_oai")] == ["model"] * 3
    assert expert_reads_for("bundles", "silu") == "bundles" and expert_reads_for("model", "relu") == "model"


def test_dense_reads_default_keeps_bundles_and_model_refuses_a_target(smollm2: Path, smol_sidecar: Path,
                                                                       tmp_path: Path) -> None:
    """convert's default --dense-reads bundles writes no pi2.dense_reads key (the sidecar earlier converts wrote);
    --dense-reads model with a sparsity target or threshold is refused by name before anything is profiled (whole
    layers have no sparsity)."""
    from pi2_gguf.converter.convert import convert
    from pi2_gguf.converter.options import DEFAULT_DENSE_READS
    from pi2_gguf.sidecar import format as fmt
    from pi2_gguf.sidecar.reader import read as read_sidecar

    assert DEFAULT_DENSE_READS == "bundles"
    sc = read_sidecar(smol_sidecar)
    assert fmt.Key.DENSE_READS not in sc.kv and not sc.whole_layers and sc.kv[fmt.Key.CALIB_TOKENS] > 0
    for flag in ({"sparsity": 0.5}, {"threshold": 0.1, "criterion": "act"}):
        with pytest.raises(Pi2Error, match="--dense-reads model reads every layer whole, which has no sparsity"):
            convert(smollm2, tmp_path / "s.pi2.gguf", dense_reads="model", progress=False, **flag)
    assert not list(tmp_path.iterdir())
