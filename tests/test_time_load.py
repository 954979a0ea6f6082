"""tools/time_load.py: times pi2_gguf.Llama's construction per sidecar, under a budget and in RAM, and prints the
table (one round on the synthetic ReLU model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_time_load_prints_a_row_per_configuration(relu_model: tuple[Path, Path, list]) -> None:
    model, sidecar, _ = relu_model
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "time_load.py"), str(model), str(sidecar),
                        "--memory-budget", "1GB", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+)x", r.stdout, re.M)
    assert [name for name, *_ in rows] == [f"{sidecar.name}, budget 1GB", f"{sidecar.name}, in RAM"], r.stdout
    assert all(0.0 < float(s) < 120.0 for _, s, _ in rows) and rows[0][2] == "1.00"
