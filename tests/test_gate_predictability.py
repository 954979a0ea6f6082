"""tools/gate_predictability.py: the low-bit copies and the bound it reports, on SmolLM2's profile."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from pi2_gguf.converter.profile import Profile

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from tool_script import load_tool  # noqa: E402


def _tool():
    return load_tool("gate_predictability")


def test_low_bit_copies_keep_signs_and_approach_the_weights_with_more_bits() -> None:
    tool = _tool()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    errs = [float(np.abs(tool.low_bit_copy(w, b) - w).mean() / np.abs(w).mean()) for b in (1, 2, 3, 4, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.01, errs
    assert (np.sign(tool.low_bit_copy(w, 1)) == np.sign(w)).all()
    assert tool.copy_row_bytes(4, 256) == 256 * 4 / 8 + 2 * 256 / 32


def test_reports_what_low_bit_predictors_must_select(smollm2: Path, smol_profile: Profile, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    prof = smol_profile.save(tmp_path / "smol.npz")
    assert _tool().main([str(smollm2), "--profile", str(prof), "--layers", "3,15", "--bits", "1,4",
                         "--tokens", "1500"]) == 0
    out = capsys.readouterr().out
    rows = {int(m[0]): [(float(a), float(r)) for a, r in re.findall(r"([0-9.]+) \(([0-9.]+)\)", m[1])]
            for m in re.findall(r"^\| (\d)-bit \| [0-9.]+x \| (.*)$", out, flags=re.M)}
    assert set(rows) == {1, 4}, out
    density = float(re.search(r"held-out active share ([0-9.]+)", out)[1])
    assert 0.4 < density < 0.6, out
    for b, cells in rows.items():
        sel = [s for s, _ in cells]
        assert sel[0] >= sel[1] >= sel[2] >= density * 0.85, out  # recall 0.99 >= 0.95 >= 0.90
        for (_, got), want in zip(cells, (0.99, 0.95, 0.90)):
            assert abs(got - want) < 0.04, out  # cutoffs from training tokens hold on held-out ones
    assert rows[4][1][0] < rows[1][1][0], out  # 4-bit copies predict better than signs


def test_refuses_a_profile_of_another_model(gemma3: Path, smol_profile: Profile, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    prof = smol_profile.save(tmp_path / "smol.npz")
    assert _tool().main([str(gemma3), "--profile", str(prof)]) == 2
    assert "profile was made for" in capsys.readouterr().err
