"""Where a layer's predictor runs (docs/BACKEND.md, "Predictor only where it pays"): where its bytes are below the
bundles it saves (a memory budget reads and caches a neuron's gate row, up row and down column as one piece), in RAM
and under a budget alike, so both decode the same tokens. convert chooses the widths by the same count
(docs/CONVERT.md)."""

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
# the sparse engine in both (test_memory_budget.py, SAME_ENGINE): in RAM prompts and many-active tokens would take
# ggml-cpu's kernels and the model's down rows, whose rounding moves a few borderline selections
SETTINGS = {None: {"sparse_batch": 64, "down_sparse_max": 1.0}, "1GB": {"sparse_batch": 64}}


def _decode(llm: pi2_gguf.Llama, n: int = 6) -> tuple[list[int], pi2_gguf.Counters]:
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    pi2_gguf.reset_counters()
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(last_logits(llm))))
        llm.eval([tokens[-1]])
    return tokens, pi2_gguf.read_counters()


@pytest.fixture(scope="module")
def wide_sidecar(relu_model: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test ReLU model (n_embd 256, n_ff 1024) with Q4_0 bundles and width-128 predictors held in Q8_0: each
    predictor's bytes (128 x (272 + 1088)) exceed the Q4_0 gate rows it saves but not the bundles."""
    model = relu_model[0]
    d = tmp_path_factory.mktemp("wide")
    return convert(model, d / "wide.pi2.gguf", bundle_type="q4_0", ranks=[128], train_tokens=2048,
                   heldout_tokens=512, progress=False, perplexity_budget=None, predictor_w2_type="q8_0").path


def test_predictor_runs_where_it_saves_bundles_though_not_gate_rows(relu_model: tuple[Path, Path, list],
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
        # the case a count of gate rows alone would part on: too dear for the gate rows, cheap against the bundles
        assert gate_saved < weights < (1.0 - pd) * bundles, il
        assert kv[Key.PREDICTOR_W2_TYPE] == "q8_0"
        assert model_stats.predictor_pays(n_embd, n_ff, rank, bundles, pd, "q8_0")
        predictor += weights + 4 * n_ff

    runs = []
    for budget in (None, "1GB"):
        llm = pi2_gguf.Llama(str(model), sidecar=wide_sidecar, mode="predicted", memory_budget=budget, n_ctx=256,
                             n_threads=2, verbose=False, settings=SETTINGS[budget])
        try:
            info = llm.cache_info()
            runs.append(_decode(llm))
        finally:
            llm.close()
    (ram, c_ram), (flash, c_flash) = runs
    # it runs in every layer, in RAM and under the budget (there kept in RAM, its bytes counted), selecting fewer
    # neurons than every gate row: the same tokens and the same selections
    assert info is not None and info.fixed_bytes == predictor
    for c in (c_ram, c_flash):
        assert np.all(c.sparse_tokens > 0) and np.all(c.predicted < c.neurons)
    assert flash == ram and np.array_equal(c_flash.predicted, c_ram.predicted)


def test_budget_holds_w2_in_the_type_the_sidecar_states(relu_model: tuple[Path, Path, list]) -> None:
    """convert's default holds each predictor's W2 in Q4_0 (pi2.predictor.w2_type): the plugin keeps exactly the bytes
    sidecar/format.predictor_decode_types says for the predictors that pay, and the planner's rule agrees on which."""
    model, side = relu_model[0], relu_model[1]
    kv = read_sidecar(side).kv
    assert kv[Key.PREDICTOR_W2_TYPE] == fmt.DEFAULT_PREDICTOR_W2_TYPE == "q4_0"
    n_embd = int(kv[Key.N_EMBD])
    want = 0
    for il in range(len(kv[Key.N_FF])):
        n_ff, rank = int(kv[Key.N_FF][il]), int(kv[Key.PREDICTOR_RANK][il])
        bundles = -(-n_ff // int(kv[Key.BUNDLE_NEURONS][il])) * int(kv[Key.BUNDLE_SIZE][il])
        if model_stats.predictor_pays(n_embd, n_ff, rank, bundles, float(kv[Key.PREDICTOR_DENSITY][il]), "q4_0"):
            w1, w2 = fmt.predictor_decode_types(n_embd, n_ff, rank, "q4_0")
            assert w2 == QT.Q4_0
            want += rank * (fmt.row_size(w1, n_embd) + fmt.row_size(w2, n_ff)) + 4 * n_ff
    assert want > 0, "no layer's predictor runs: the test checks nothing"
    llm = pi2_gguf.Llama(str(model), sidecar=side, mode="predicted", memory_budget="1GB", n_ctx=256, n_threads=2,
                         verbose=False)
    try:
        info = llm.cache_info()
    finally:
        llm.close()
    assert info is not None and info.fixed_bytes == want
