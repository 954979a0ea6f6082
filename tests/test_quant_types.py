"""Every FFN weight type: SmolLM2 re-quantized by llama.cpp itself, then decoded with single-token
steps by stock llama.cpp (repacking off) and by pi2: the logits must be bit-identical, which also
shows the weight's type really reached PI2 (counters)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGUFReader

from pi2_gguf.runtime.isolated import greedy_in_subprocess

FTYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "IQ4_NL": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}


@pytest.fixture(scope="module")
def quantized(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("quant")
    made = {}
    for name, ftype in FTYPES.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = 2
        dst = out / f"smollm2-{name}.gguf"
        assert llama_cpp.llama_model_quantize(str(smollm2).encode(), str(dst).encode(), params) == 0
        made[name] = dst
    return made


@pytest.mark.parametrize("name", list(FTYPES))
def test_decode_steps_bit_identical(quantized: dict[str, Path], name: str) -> None:
    path = quantized[name]
    types = {t.tensor_type.name for t in GGUFReader(path).tensors if ".ffn_" in t.name and t.name.endswith("weight")
             and "norm" not in t.name}
    assert name in types, f"llama.cpp wrote no {name} FFN weight: {types}"
    stock = greedy_in_subprocess(path, ["Once upon a time"], 16, pi2=False, repack=False, prompt_limit=1)[0]
    mine = greedy_in_subprocess(path, ["Once upon a time"], 16, pi2=True, repack=False, prompt_limit=1)[0]
    assert np.array_equal(np.array(mine.logits_first), np.array(stock.logits_first))
    assert mine.tokens == stock.tokens
    n_layer = 30
    assert mine.pi2_matmuls == n_layer * 3 * 16  # one prompt token + 15 decode steps, every FFN matmul in PI2
    assert stock.pi2_matmuls == 0
