"""Where a layer's predictor runs (docs/BACKEND.md, "Predictor only where it pays"): in RAM where its bytes are below
the gate rows it saves, under a memory budget below the bundles it saves (a budget reads and caches a neuron's gate
row, up row and down column as one piece). convert chooses the widths by the same count (docs/CONVERT.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import pi2_gguf
from pi2_gguf.converter.convert import convert
from pi2_gguf.planner import model_stats
from pi2_gguf.runtime.generate import last_logits
from pi2_gguf.sidecar import format as fmt
from pi2_gguf.sidecar.format import Key
from pi2_gguf.sidecar.reader import read as read_sidecar

PROMPT = "The history of the Roman Empire"


def _decode(llm: pi2_gguf.Llama, n: int = 6) -> pi2_gguf.Counters:
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    pi2_gguf.reset_counters()
    for _ in range(n):
        llm.eval([int(np.argmax(last_logits(llm)))])
    return pi2_gguf.read_counters()


@pytest.fixture(scope="module")
def wide_sidecar(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test ReLU model (n_embd 256, n_ff 1024) with Q4_0 bundles and width-128 predictors: each predictor's
    Q8_0 bytes (128 x (272 + 1088)) exceed the Q4_0 gate rows it saves but not the bundles."""
    model = relu_model[0]
    d = tmp_path_factory.mktemp("wide")
    return convert(model, d / "wide.pi2.gguf", bundle_type="q4_0", ranks=[128], train_tokens=2048,
                   heldout_tokens=512, progress=False, perplexity_budget=None).path


def test_predictor_runs_under_a_budget_where_it_saves_bundles_not_gate_rows(relu_model: tuple[Path, Path, list],
                                                                            wide_sidecar: Path) -> None:
    model = relu_model[0]
    sc = read_sidecar(wide_sidecar)
    kv = sc.kv
    n_embd = int(kv[Key.N_EMBD])
    predictor = 0
    for il in range(sc.n_layer):
        n_ff, rank = int(kv[Key.N_FF][il]), int(kv[Key.PREDICTOR_RANK][il])
        pd = float(kv[Key.PREDICTOR_DENSITY][il])
        # as the plugin keeps it: Q8_0 rows of W1 and W2 (the widths allow it), and W2's bias per neuron
        weights = rank * (fmt.row_size(QT.Q8_0, n_embd) + fmt.row_size(QT.Q8_0, n_ff))
        gate_saved = (1.0 - pd) * n_ff * fmt.row_size(int(kv[Key.BUNDLE_GATE_TYPE][il]), n_embd)
        bundles = -(-n_ff // int(kv[Key.BUNDLE_NEURONS][il])) * int(kv[Key.BUNDLE_SIZE][il])
        # the case the two rules part on: too dear for the gate rows, cheap against the bundles
        assert gate_saved < weights < (1.0 - pd) * bundles, il
        assert model_stats.predictor_pays(n_embd, n_ff, rank, bundles, pd)
        predictor += weights + 4 * n_ff

    ram = pi2_gguf.Llama(str(model), sidecar=wide_sidecar, mode="predicted", n_ctx=256, n_threads=2, verbose=False)
    try:
        c = _decode(ram)
    finally:
        ram.close()
    # in RAM the predictor does not pay: every gate row is computed
    assert np.all(c.sparse_tokens > 0) and np.array_equal(c.predicted, c.neurons)

    flash = pi2_gguf.Llama(str(model), sidecar=wide_sidecar, mode="predicted", memory_budget="1GB", n_ctx=256,
                           n_threads=2, verbose=False)
    try:
        info = flash.cache_info()
        c = _decode(flash)
    finally:
        flash.close()
    # under a budget it runs in every layer, kept in RAM (its bytes counted in the budget), and selects fewer
    assert info is not None and info.fixed_bytes == predictor
    assert np.all(c.sparse_tokens > 0) and np.all(c.predicted < c.neurons)
