"""`pi2-gguf import`: a Hugging Face checkpoint of each sparse family (tiny, random, shipped as those models
ship) becomes a GGUF, through llama.cpp's own converter, that states its FFN activation; its logits through
the plugin equal a numpy forward pass of the checkpoint, on llama-cpp-python built with and without
patches/. Predictors a checkpoint ships are used when they read less, or ignored with a reason."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import pi2_gguf
from pi2_gguf.cli import main as cli_main
from pi2_gguf.converter.convert import convert
from pi2_gguf.errors import CheckpointImportError
from pi2_gguf.gguf_file import read_model_file
from pi2_gguf.importer.hf_import import import_checkpoint
from pi2_gguf.llama_build import ensure_stock_site
from pi2_gguf.runtime.generate import last_logits
from pi2_gguf.runtime.isolated import greedy_in_subprocess
from pi2_gguf.sidecar.reader import read as read_sidecar

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
import hf_checkpoint as hfc  # noqa: E402

PROMPT = "The history of the Roman Empire covers"
# activation codes of pi2_model_summary (the plugin's enum pi2_activation)
CODES = {"relu": 3, "drelu": 4, "fatrelu": 5}
STATED = {"bamboo": "drelu", "prosparse": "fatrelu", "relullama": "relu", "sparseqwen2": "relu"}


@pytest.fixture(scope="module", params=list(hfc.FAMILIES))
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[hfc.Family, Path, Path]:
    """(family, checkpoint dir, GGUF imported as f32)."""
    fam = hfc.FAMILIES[request.param]
    d = tmp_path_factory.mktemp(fam.name)
    ckpt = d / "checkpoint"
    hfc.write(ckpt, fam)
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    res = import_checkpoint(ckpt, d / f"{fam.name}.gguf", "f32")
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before  # the checkpoint is only read
    assert sorted(p.name for p in d.iterdir()) == sorted(["checkpoint", f"{fam.name}.gguf"])  # no temporary left
    return fam, ckpt, res.path


@pytest.fixture(scope="module")
def stock_site() -> Path:
    return ensure_stock_site(log=lambda _: None)


def test_gguf_states_the_activation(imported: tuple[hfc.Family, Path, Path]) -> None:
    fam, _, model = imported
    summary = read_model_file(model)[1]
    assert summary.activation == CODES[STATED[fam.name]]
    want_t = 0.01 if fam.name == "prosparse" else 0.0
    assert summary.activation_threshold == pytest.approx(want_t)


def test_logits_through_plugin_equal_numpy_reference(imported: tuple[hfc.Family, Path, Path]) -> None:
    """Every position, token by token through the plugin (llama-cpp-python with patches/), against the
    float64 forward pass of the checkpoint's own weights."""
    fam, ckpt, model = imported
    llm = pi2_gguf.Llama(str(model), n_ctx=64, n_threads=2, verbose=False)
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=True)
        pi2_gguf.reset_counters()
        rows = []
        for t in toks:
            llm.eval([t])
            rows.append(last_logits(llm).copy())
        assert pi2_gguf.read_counters().matmul_calls.sum() > 0
    finally:
        llm.close()
    got, ref = np.stack(rows), hfc.forward(ckpt, fam, toks)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 3e-3 * scale, np.abs(got - ref).max() / scale
    assert (got.argmax(1) == ref.argmax(1)).all()


def _reference_greedy(fam: hfc.Family, ckpt: Path, toks: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(hfc.forward(ckpt, fam, toks + out)[-1].argmax()))
    return out


def test_unpatched_llama_with_plugin_equals_reference(imported: tuple[hfc.Family, Path, Path], stock_site: Path) -> None:
    """llama-cpp-python built without patches/ (whose graph holds SwiGLU for llama and qwen2): with the
    plugin, the reference's logits and greedy tokens; without it, other logits (the check can fail)."""
    fam, ckpt, model = imported
    run = greedy_in_subprocess(model, [PROMPT], 4, pi2=True, ctx=64, llama_site=stock_site)[0]
    patched = greedy_in_subprocess(model, [PROMPT], 4, pi2=True, ctx=64)[0]
    silu = greedy_in_subprocess(model, [PROMPT], 4, pi2=False, ctx=64, llama_site=stock_site)[0]
    llm = pi2_gguf.Llama(str(model), n_ctx=64, verbose=False)
    toks = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.close()
    ref = hfc.forward(ckpt, fam, toks)[-1]
    scale = np.abs(ref).max()
    assert run.pi2_matmuls > 0
    assert np.abs(np.array(run.logits_first) - ref).max() <= 3e-3 * scale
    assert np.abs(np.array(run.logits_first) - np.array(patched.logits_first)).max() <= 1e-5 * scale
    assert run.tokens == patched.tokens == _reference_greedy(fam, ckpt, toks, 4)
    assert np.abs(np.array(silu.logits_first) - ref).max() > 3e-2 * scale


def test_quantized_outtype_through_llama_quantizer(tmp_path: Path) -> None:
    fam = hfc.FAMILIES["prosparse"]
    ckpt = tmp_path / "ckpt"
    hfc.write(ckpt, fam)
    res = import_checkpoint(ckpt, tmp_path / "q.gguf", "q8_0")
    res4 = import_checkpoint(ckpt, tmp_path / "q4.gguf", "q4_k_m")
    for r in (res, res4):
        summary = read_model_file(r.path)[1]
        assert summary.activation == CODES["fatrelu"] and summary.activation_threshold == pytest.approx(0.01)
        assert oct(r.path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert res4.path.stat().st_size < res.path.stat().st_size
    llm = pi2_gguf.Llama(str(res.path), n_ctx=64, n_threads=2, verbose=False)
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=True)
        llm.eval(toks)
        got = last_logits(llm).copy()
    finally:
        llm.close()
    ref = hfc.forward(ckpt, fam, toks)[-1]
    assert np.abs(got - ref).max() <= 5e-2 * np.abs(ref).max()  # Q8_0 weights


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_checkpoint_predictors_used_when_they_read_less(tmp_path: Path) -> None:
    """Bamboo ships predictors. Exact ones (their output is the gate itself) beat convert's own at rank 2
    and go into the sidecar; random ones read more than convert's and are ignored, with the reason."""
    fam = hfc.FAMILIES["bamboo"]
    for exact in (True, False):
        d = tmp_path / ("exact" if exact else "random")
        hfc.write(d / "ckpt", fam, exact_predictors=exact)
        model = import_checkpoint(d / "ckpt", d / "m.gguf", "f32").path
        res = convert(model, d / "m.pi2.gguf", ranks=[2], train_tokens=1024, heldout_tokens=256, progress=False,
                      checkpoint=d / "ckpt", perplexity_budget=None)
        notes = tuple(n for n in res.notes if n.startswith("checkpoint"))
        sc = read_sidecar(res.path)
        ranks = list(sc.kv["pi2.predictor.rank"])
        if exact:
            assert ranks == [2 * hfc.SHAPE["hidden_size"]] * hfc.SHAPE["num_hidden_layers"]
            assert notes == ("checkpoint predictors used in 2 of 2 layers",)
            assert min(sc.kv["pi2.predictor.recall"]) >= 0.95
        else:
            assert ranks == [2, 2]
            assert len(notes) == 1 and "used in 0 of 2 layers" in notes[0] and "read more" in notes[0]


def test_checkpoint_predictors_of_wrong_shape_are_ignored(tmp_path: Path) -> None:
    fam = hfc.FAMILIES["bamboo"]
    hfc.write(tmp_path / "ckpt", fam)
    model = import_checkpoint(tmp_path / "ckpt", tmp_path / "m.gguf", "f32").path
    other = tmp_path / "other"
    hfc.write(other, fam)
    from safetensors.numpy import load_file, save_file

    t = load_file(str(other / "model.safetensors"))
    t["model.layers.1.mlp.predictor.fc1.weight"] = t["model.layers.1.mlp.predictor.fc1.weight"][:, :32]
    save_file(t, str(other / "model.safetensors"))
    res = convert(model, tmp_path / "m.pi2.gguf", train_tokens=512, heldout_tokens=256, progress=False,
                  checkpoint=other, perplexity_budget=None)
    assert any("partly ignored: layer 1: fc1 (16, 32)" in n for n in res.notes), res.notes


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli_main(argv)
    return rc, capsys.readouterr().err


def test_bad_checkpoints_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(["import", str(tmp_path / "nope")], capsys)
    assert rc == 2 and "not a directory" in err
    (tmp_path / "empty").mkdir()
    rc, err = _cli(["import", str(tmp_path / "empty")], capsys)
    assert rc == 2 and "no config.json" in err
    ck = tmp_path / "ck"
    hfc.write(ck, hfc.FAMILIES["relullama"])
    cfg = json.loads((ck / "config.json").read_text())
    for change, message in (({"hidden_act": "gelu"}, "llama.cpp would compute SiLU instead"),
                            ({"architectures": ["GPT2LMHeadModel"]}, "not one pi2-gguf import knows"),
                            ({"architectures": ["SparseLlamaForCausalLM"], "hidden_act": "fatrelu",
                              "hidden_act_param": -1}, "finite threshold >= 0")):
        (ck / "config.json").write_text(json.dumps({**cfg, **change}))
        rc, err = _cli(["import", str(ck), "-o", str(tmp_path / "x.gguf")], capsys)
        assert rc == 2 and message in err, err
        assert "Traceback" not in err
    (ck / "config.json").write_text("{not json")
    rc, err = _cli(["import", str(ck)], capsys)
    assert rc == 2 and "cannot be read as JSON" in err
    (ck / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(["import", str(ck), "-o", str(tmp_path)], capsys)
    assert rc == 2 and "is a directory" in err
    # weights cut short: the converter fails, the message says so, and no output (or temporary) is left
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _cli(["import", str(ck), "-o", str(out / "m.gguf")], capsys)
    assert rc == 2 and "model.safetensors" in err and "Traceback" not in err.splitlines()[0]
    assert list(out.iterdir()) == []
