"""The plugin's reading of a model file before llama loads it (pi2_model_summary): the same fingerprint and
sizes as gguf-py's reading, a clear refusal of bad files, and little memory for a large vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from pi2_gguf.converter.model_ffn import ModelFfn
from pi2_gguf.errors import ModelFileError
from pi2_gguf.gguf_file import read_model_file
from pi2_gguf.runtime.native import model_summary_c


def _same_as_gguf_py(path: Path) -> None:
    s = model_summary_c(path)
    ffn = ModelFfn(path)
    sizes = {t.name: int(t.n_bytes) for t in ffn.reader.tensors}
    assert s.fingerprint == ffn.fingerprint()
    assert s.n_layer == ffn.n_layer
    assert s.ffn_bytes == sum(int(t.data.nbytes) for layer in ffn.layers for t in layer.values())
    assert s.embedding_bytes == (sizes["token_embd.weight"] if "output.weight" in sizes else 0)
    assert s.n_tensors == len(sizes) and s.file_size == path.stat().st_size


def test_summary_of_a_tied_model_equals_gguf_py(smollm2: Path) -> None:
    _same_as_gguf_py(smollm2)
    assert model_summary_c(smollm2).embedding_bytes == 0  # tied: the embedding is the output matrix too


def _write_model(path: Path, layers: list[dict[str, np.ndarray]], extra: dict[str, np.ndarray] | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    for il, layer in enumerate(layers):
        for name, data in layer.items():
            w.add_tensor(f"blk.{il}.ffn_{name}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ffn(n_embd: int = 32, n_ff: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"gate": rng.standard_normal((n_ff, n_embd), dtype=np.float32),
            "up": rng.standard_normal((n_ff, n_embd), dtype=np.float32),
            "down": rng.standard_normal((n_embd, n_ff), dtype=np.float32)}


def test_small_model_summaries(tmp_path: Path) -> None:
    tied = _write_model(tmp_path / "tied.gguf", [_ffn(), _ffn()], {"token_embd.weight": np.ones((100, 32), np.float32)})
    _same_as_gguf_py(tied)
    assert model_summary_c(tied).n_layer == 2 and model_summary_c(tied).embedding_bytes == 0
    untied = _write_model(tmp_path / "untied.gguf", [_ffn(), _ffn()], {"token_embd.weight": np.ones((100, 32), np.float32),
                                                                       "output.weight": np.ones((100, 32), np.float32)})
    _same_as_gguf_py(untied)
    assert model_summary_c(untied).embedding_bytes == 100 * 32 * 4  # its rows are read from the file under a budget
    no_ffn = _write_model(tmp_path / "no_ffn.gguf", [], {"token_embd.weight": np.ones((100, 32), np.float32)})
    s = model_summary_c(no_ffn)
    assert (s.n_layer, s.fingerprint, s.ffn_bytes, s.n_tensors) == (0, 0, 0, 1)


@pytest.mark.parametrize("case, message", [
    ("no_up", "has blk.1.ffn_gate.weight but no blk.1.ffn_up.weight"),
    ("shapes", "layer 0 FFN shapes disagree: gate 32x64, up 32x64, down 32x48"),
    ("three_d", "blk.0.ffn_up.weight has 3 dimensions, expected 2"),
    ("truncated", "is truncated: tensor blk.1.ffn_down.weight needs bytes up to"),
    ("header", "is not a readable GGUF file: its header is corrupt or truncated"),
])
def test_bad_model_files_are_refused_by_name(tmp_path: Path, case: str, message: str) -> None:
    layers = [_ffn(), _ffn()]
    if case == "no_up":
        del layers[1]["up"]
    elif case == "shapes":
        layers[0]["down"] = np.zeros((48, 32), dtype=np.float32)
    elif case == "three_d":
        layers[0]["up"] = np.zeros((2, 64, 16), dtype=np.float32)
    path = _write_model(tmp_path / "m.gguf", layers)
    if case == "truncated":
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - 1)
    elif case == "header":
        with path.open("r+b") as f:
            f.truncate(40)
    before = path.read_bytes()
    with pytest.raises(ModelFileError) as e:
        read_model_file(path)
    assert str(e.value).startswith(f"model file {path}: ") and message in str(e.value)
    assert path.read_bytes() == before  # never modified


def test_reading_a_model_costs_little_memory(smollm2: Path) -> None:
    """gguf-py's reader builds Python objects for every vocabulary entry: on SmolLM2 (49,152 tokens) the process
    peaked 167 MB higher and kept 18 MB after dropping it; ggml's reader in the plugin keeps a few MB at most."""
    code = (
        "import gc, json, re, sys\n"
        "from pathlib import Path\n"
        "from pi2_gguf.gguf_file import read_model_file\n"
        "from pi2_gguf.converter.model_ffn import ModelFfn\n"
        "def peak_and_now():\n"
        "    s = open('/proc/self/status').read()\n"
        "    return [int(re.search(k + r':\\s+(\\d+)', s).group(1)) * 1024 for k in ('VmHWM', 'VmRSS')]\n"
        "m = Path(sys.argv[1])\n"
        "read_model_file(m); gc.collect()  # the plugin library and llama_cpp loaded, once\n"
        "out = {}\n"
        "for name, read in (('plugin', read_model_file), ('gguf_py', ModelFfn)):\n"
        "    open('/proc/self/clear_refs', 'w').write('5')\n"
        "    _, before = peak_and_now()\n"
        "    x = read(m); del x; gc.collect()\n"
        "    peak, after = peak_and_now()\n"
        "    out[name] = [peak - before, after - before]\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code, str(smollm2)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["plugin"][0] < 16e6 and out["plugin"][1] < 8e6, out
    assert out["gguf_py"][0] > 50e6, out  # the reader this replaced, measured the same way


def test_sidecar_for_a_model_without_ffn_layers_is_refused(tmp_path: Path, smol_sidecar: Path) -> None:
    from pi2_gguf.errors import SidecarError
    from pi2_gguf.runtime.llama import prepare_sidecar

    no_ffn = _write_model(tmp_path / "no_ffn.gguf", [], {"token_embd.weight": np.ones((100, 32), np.float32)})
    with pytest.raises(SidecarError, match=f"sidecar {smol_sidecar}: no_ffn.gguf has no gated FFN layers"):
        prepare_sidecar(no_ffn, smol_sidecar, None, model_summary_c(no_ffn))
    with pytest.raises(SidecarError, match="was made for another model"):
        prepare_sidecar(_write_model(tmp_path / "m.gguf", [_ffn()]), smol_sidecar, None)


def test_header_tensors_match_gguf_py_and_refuse_a_truncated_header(smollm2: Path, tmp_path: Path) -> None:
    """The planner's header reader (gguf_file.header_tensors, the walker gguf_architecture uses too) gives every
    tensor's name, type, shape and size as gguf-py reads them, the wanted keys' values, and a header cut short is a
    ModelFileError naming the file."""
    from gguf import GGUFReader

    from pi2_gguf.gguf_file import header_tensors

    kv, infos = header_tensors(smollm2, {"general.architecture", "llama.block_count"})
    assert kv == {"general.architecture": "llama", "llama.block_count": 30}
    want = [(t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.n_bytes)) for t in GGUFReader(smollm2).tensors]
    assert [(t.name, t.qtype, t.shape, t.n_bytes) for t in infos] == want
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[:1 << 20])  # inside the tokenizer's arrays
    with pytest.raises(ModelFileError, match=r"cut\.gguf: truncated header"):
        header_tensors(cut, set())
