"""An FFN graph PowerInfer-2's sparse decode does not match (here: an FFN with biases) runs dense in RAM,
said once per layer, and is refused under a memory budget (its weights are nowhere but on flash): a clear
error, never a read of the reserved address range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import pi2_gguf
from pi2_gguf.errors import SidecarError

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from gguf_copy import copy_gguf  # noqa: E402

UNFIT = "its gate and up products do not feed one GLU directly"


def _with_ffn_biases(src: Path, dst: Path) -> Path:
    """src with zero blk.N.ffn_gate.bias tensors: the same function, a graph with an ADD between the gate
    matmul and the GLU (the sidecar still matches: it fingerprints the weights)."""
    return copy_gguf(src, dst, lambda name, data: [(name.replace(".weight", ".bias"), np.zeros(data.shape[0], np.float32))]
                     if name.endswith("ffn_gate.weight") else [])


@pytest.fixture(scope="module")
def biased(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model, sidecar, _ = relu_model
    return _with_ffn_biases(model, tmp_path_factory.mktemp("biased") / "biased.gguf"), sidecar


def _greedy(llm: pi2_gguf.Llama, n: int = 8) -> list[int]:
    llm.reset()
    out = llm.create_completion("The history of", max_tokens=n, temperature=0.0)
    return llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False)


def test_unfit_ffn_runs_dense_in_ram(biased: tuple[Path, Path], relu_model: tuple[Path, Path, list]) -> None:
    model, sidecar = biased
    pi2_gguf.register()
    pi2_gguf.reset_counters()
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode="predicted", n_ctx=128, n_threads=2, verbose=False)
    got = _greedy(llm)
    c = pi2_gguf.read_counters()
    llm.close()
    assert int(c.sparse_tokens.sum()) == 0 and int(c.matmul_calls.sum()) > 0  # PI2 ran it, densely
    ref = pi2_gguf.Llama(str(relu_model[0]), sidecar=sidecar, mode="dense", n_ctx=128, n_threads=2, verbose=False)
    want = _greedy(ref)
    ref.close()
    assert got == want  # zero biases: the same model


def test_unfit_ffn_is_said_once_per_layer(biased: tuple[Path, Path]) -> None:
    model, sidecar = biased
    code = (f"import pi2_gguf\nllm = pi2_gguf.Llama({str(model)!r}, sidecar={str(sidecar)!r}, n_ctx=128, verbose=True)\n"
            "llm.create_completion('The history of', max_tokens=4, temperature=0.0)\nprint('DECODED')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "DECODED" in r.stdout, r.stderr[-2000:]
    n_layer = int(GGUFReader(model).fields["llama.block_count"].contents())
    for il in range(n_layer):
        assert r.stderr.count(f"pi2: layer {il} runs dense, not sparse: {UNFIT}") == 1, r.stderr[-3000:]


def test_unfit_ffn_under_a_budget_is_refused_at_load(biased: tuple[Path, Path]) -> None:
    """llama reserves its graphs while the context is made; the plugin sees the layer there."""
    model, sidecar = biased
    with pytest.raises(SidecarError, match=f"layer 0 cannot run from flash: {UNFIT}"):
        pi2_gguf.Llama(str(model), sidecar=sidecar, memory_budget="4GB", n_ctx=128, n_threads=2, verbose=False)


def test_unfit_ffn_under_an_env_budget_fails_the_decode_not_the_process(biased: tuple[Path, Path]) -> None:
    """Other frontends (PI2_SIDECAR + PI2_MEMORY_BUDGET): the decode fails with the message; no crash."""
    model, sidecar = biased
    code = ("import llama_cpp, pi2_gguf\npi2_gguf.register()\n"
            f"llm = llama_cpp.Llama({str(model)!r}, n_ctx=128, use_mmap=False, verbose=False)\n"
            "try:\n    llm.eval(llm.tokenize(b'The history of'))\nexcept RuntimeError:\n    print('REFUSED')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PI2_SIDECAR=str(sidecar), PI2_MEMORY_BUDGET="4GB"))
    assert r.returncode == 0 and "REFUSED" in r.stdout, r.stderr[-2000:]
    assert f"layer 0 cannot run from flash: {UNFIT}" in r.stderr
