"""tools/peer_model.py: the transposed-down GGUF SmallThinker's own engine streams, from a smallthinker model made by
make_model. Its ffn_down_exps equal the stock file's transposed (both dequantized; Q4_0's rounding of the transposed
blocks apart), every other tensor and key is copied, and models the engine cannot stream are refused. Needs no peer
build (the bundle step runs the engine and is not tested here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from pi2_gguf.converter import synthetic, synthetic_moe

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from tool_script import load_tool  # noqa: E402

peer_model = load_tool("peer_model")

# n_embd * n_ff a multiple of 65536: an expert matrix in Q4_0 is whole 4096-byte pages, as the engine asserts
SHAPE = synthetic_moe.MoeShape(n_embd=256, n_ff=256, n_layer=2, n_head=4, n_head_kv=2, n_expert=4, n_expert_used=2,
                               n_ctx=256)


def _make(path: Path, qtype: QT = QT.Q4_0, arch: str = "smallthinker", shape: synthetic_moe.MoeShape = SHAPE) -> Path:
    synthetic_moe.make_moe(path, shape, synthetic.Sparsity(density=0.15), synthetic_moe.Routing(1.0, 0.5), arch,
                           "relu", qtype, progress=False)
    return path


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("peer_model") / "st.gguf")


def test_down_is_transposed_and_the_rest_copied(stock: Path) -> None:
    before = stock.read_bytes()
    out = peer_model.write_transposed(stock, peer_model.transposed_path(stock))
    assert out.name == "st-T.gguf" and stock.read_bytes() == before  # the input untouched
    src, dst = GGUFReader(stock), GGUFReader(out)
    assert [t.name for t in src.tensors] == [t.name for t in dst.tensors]
    downs = 0
    for a, b in zip(src.tensors, dst.tensors):
        assert b.tensor_type == a.tensor_type
        if not a.name.endswith(".ffn_down_exps.weight"):
            assert list(b.shape) == list(a.shape) and np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
            continue
        downs += 1
        n_ff, n_embd, n_expert = (int(x) for x in a.shape)
        assert [int(x) for x in b.shape] == [n_embd, n_ff, n_expert]  # up's and gate's shape
        want = quants.dequantize(np.asarray(a.data), QT.Q4_0).reshape(n_expert, n_embd, n_ff).transpose(0, 2, 1)
        got = quants.dequantize(np.asarray(b.data), QT.Q4_0).reshape(n_expert, n_ff, n_embd)
        # Q4_0 keeps a block of 32 as d * q, d = its largest |value| / 8, q in -8..7: rounding moves a value by at most d
        # (the largest itself, at the clipped end, by d; the fp16 scale adds a little)
        step = np.abs(want).reshape(-1, 32).max(axis=1, keepdims=True) / 8
        err = np.abs(got - want).reshape(-1, 32)
        assert np.all(err <= step * 1.01 + 1e-7)
        assert np.abs(got - want).mean() < 0.1 * np.abs(want).mean()
        assert np.array_equal(got, quants.dequantize(quants.quantize(np.ascontiguousarray(want), QT.Q4_0), QT.Q4_0))
    assert downs == SHAPE.n_layer
    assert {k for k in dst.fields if not k.startswith("GGUF.")} == \
        {k for k in src.fields if not k.startswith("GGUF.")} | {"smallthinker.pi2_peer_note"}
    assert int(dst.fields["smallthinker.expert_count"].contents()) == SHAPE.n_expert
    # the transposed file is refused as an input: its down is no longer the stock layout
    with pytest.raises(peer_model.PeerModelError, match="already transposed"):
        peer_model.write_transposed(out, out.with_name("again.gguf"))


def test_cli_writes_beside_the_model_and_prints_no_command_without_the_engine(
        stock: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x-T.gguf"
    assert peer_model.main([str(stock), "-o", str(out)]) == 0
    assert out.is_file() and capsys.readouterr().out == ""
    assert not list(tmp_path.glob(".*.tmp"))


def test_bad_inputs_are_refused(stock: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q4k = _make(tmp_path / "q4k.gguf", QT.Q4_K)
    with pytest.raises(peer_model.PeerModelError, match="is Q4_K; the engine's expert bundle holds Q4_0"):
        peer_model.write_transposed(q4k, tmp_path / "q4k-T.gguf")
    qwen = _make(tmp_path / "qwen.gguf", arch="qwen3moe")
    with pytest.raises(peer_model.PeerModelError, match="is a qwen3moe model"):
        peer_model.write_transposed(qwen, tmp_path / "qwen-T.gguf")
    odd = _make(tmp_path / "odd.gguf", shape=synthetic_moe.MoeShape(
        n_embd=256, n_ff=128, n_layer=1, n_head=4, n_head_kv=2, n_expert=4, n_expert_used=2, n_ctx=256))
    with pytest.raises(peer_model.PeerModelError, match="whole number of 4096-byte pages"):
        peer_model.write_transposed(odd, tmp_path / "odd-T.gguf")
    with pytest.raises(peer_model.PeerModelError, match="is the input"):
        peer_model.write_transposed(stock, stock)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert peer_model.main([str(tmp_path / "junk.gguf")]) == 2
    assert "is not a readable GGUF" in capsys.readouterr().err
    assert not (tmp_path / "junk-T.gguf").exists() and not list(tmp_path.glob(".*.tmp"))
    assert peer_model.main([str(stock), "-o", str(tmp_path / "s-T.gguf"), "--llama-cli", str(tmp_path / "none")]) == 2
    assert "is not the engine's llama-cli" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # under the engine's I/O queue depth: it would exit
        peer_model.main([str(stock), "-o", str(tmp_path / "c-T.gguf"), "--cached", "100"])
    assert "I/O queue depth, 512" in capsys.readouterr().err and not (tmp_path / "c-T.gguf").exists()


def test_peer_command_names_the_transposed_file(tmp_path: Path) -> None:
    from pi2_gguf.bench.peers import parse_peer, peer_command

    arg = peer_model.peer_command(Path("/b/llama-cli"), Path("/m/st-T.gguf"), Path("/m/st.bundle"), 768)
    peer = parse_peer(arg)
    assert peer.name == "smallthinker"
    cmd = peer_command(peer, "/m/st.gguf", "Once upon a time", 32, 2)
    assert cmd == ["env", "MAX_N_CACHED=768", "EXPERT_BUNDLE_PATH=/m/st.bundle", "/b/llama-cli", "-m", "/m/st-T.gguf",
                   "-no-cnv", "--temp", "0", "-p", "Once upon a time", "-n", "32", "-t", "2", "-ub", "4"]
