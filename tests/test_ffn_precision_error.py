"""tools/ffn_precision_error.py: the error of a layer's FFN output with its cold neurons at a lower precision."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pi2_gguf.converter.profile import Profile

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from tool_script import load_tool  # noqa: E402


def _tool():
    return load_tool("ffn_precision_error")


def test_more_neurons_kept_exact_means_less_error(smollm2: Path, smol_profile: Profile, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    prof = smol_profile.save(tmp_path / "smol.npz")
    tool = _tool()
    assert tool.main([str(smollm2), str(prof), "--type", "q4_0", "--layers", "2,20", "--tokens", "128",
                      "--rank-tokens", "256"]) == 0
    rows = re.findall(r"^\| (\d+) \(\w+\) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| (\d+)% \|", capsys.readouterr().out,
                      flags=re.M)
    assert [int(r[0]) for r in rows] == [2, 20]
    for r in rows:
        errors = [float(v) for v in r[1:5]]
        assert 0.0 < errors[-1] < errors[0], errors  # half the neurons exact: less error than none
        assert all(a >= b for a, b in zip(errors, errors[1:])), errors
        assert 33 < int(r[5]) <= 100  # the top third carries more than a third of the energy
    # a finer type errs less than a coarser one on the same neurons
    q4, q8 = (tool.layer_errors(tool.ModelFfn(smollm2), smol_profile, 2, tool.QT[t], 64, 128)[0][0] for t in ("Q4_0", "Q8_0"))
    assert q8 < 0.2 * q4, (q8, q4)


def test_refuses_bad_input(smollm2: Path, gemma3: Path, smol_profile: Profile, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    prof = smol_profile.save(tmp_path / "smol.npz")
    tool = _tool()
    for argv, message in (([str(gemma3), str(prof)], "profile was made for"),
                          ([str(smollm2), str(prof), "--type", "q9_z"], "not a ggml type"),
                          ([str(smollm2), str(prof), "--layers", "99"], "has layers 0.."),
                          ([str(smollm2), str(prof), "--type", "q3_k"], "do not divide")):
        with pytest.raises(SystemExit):
            tool.main(argv)
        assert message in capsys.readouterr().err
