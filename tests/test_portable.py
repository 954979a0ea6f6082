"""The plugin's C compiles for the platform PowerInfer-2 was built for: every source file compiled for
aarch64 with Debian's cross compiler (against the same ggml headers), and for this machine, with -Wall
-Wextra and no warnings (x86 intrinsics sit behind ISA checks with portable fallbacks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pi2_gguf import llama_build

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "ggml-backend" / "src").rglob("*.c"))
DEFINES = ["-DGGML_BACKEND_DL", "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", "-DGGML_SHARED", "-DGGML_BUILD",
           "-D_POSIX_C_SOURCE=200809L"]


def _compile_all(cc: str, extra: list[str], out: Path) -> list[str]:
    ggml = llama_build.ensure_wheel(ROOT / "patches").ggml_dir
    problems = []
    for src in SOURCES:
        cmd = [cc, "-std=c11", "-O2", "-fopenmp", "-Wall", "-Wextra", "-Werror", *extra, *DEFINES,
               f"-I{ROOT / 'ggml-backend' / 'include'}", f"-I{ROOT / 'ggml-backend' / 'src'}", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
               "-c", str(src), "-o", str(out / (src.name + ".o"))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or r.stderr.strip():
            problems.append(f"{src.name}:\n{r.stderr}")
    return problems


def test_plugin_compiles_for_aarch64_without_warnings(tmp_path: Path) -> None:
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        if os.environ.get("CI"):
            pytest.fail("aarch64-linux-gnu-gcc missing: .ci/run installs gcc-aarch64-linux-gnu")
        pytest.skip("no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
    assert SOURCES
    problems = _compile_all(cc, [], tmp_path)
    assert not problems, "\n".join(problems)
    arch = subprocess.run(["file", str(tmp_path / "ggml-pi2.c.o")], capture_output=True, text=True).stdout
    assert "aarch64" in arch or "ARM" in arch, arch


def test_plugin_compiles_here_without_warnings(tmp_path: Path) -> None:
    problems = _compile_all(os.environ.get("CC", "cc"), ["-march=native"], tmp_path)
    assert not problems, "\n".join(problems)
