"""Bad input gets a clear error naming the problem, never a crash."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

import pi2_gguf
from pi2_gguf.errors import ModelFileError, PluginError, VersionMismatchError
from pi2_gguf.runtime.capi import plugin_path
from pi2_gguf.runtime.plugin import check_llama_cpp_version


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="model file not found"):
        pi2_gguf.Llama(str(tmp_path / "nope.gguf"))


def test_directory_instead_of_model(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="not a file"):
        pi2_gguf.Llama(str(tmp_path))


def test_non_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        pi2_gguf.Llama(str(bad))


@pytest.mark.parametrize("keep", [0.5, 0.999, 64 / 98362432])
def test_truncated_gguf(smollm2: Path, tmp_path: Path, keep: float) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(max(int(smollm2.stat().st_size * keep), 8)))
    with pytest.raises(ModelFileError, match="truncated"):
        pi2_gguf.Llama(str(cut))
    assert smollm2.stat().st_size == 98362432  # the input is never modified


def test_unsupported_llama_cpp_python_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "__version__", "0.2.90")
    with pytest.raises(VersionMismatchError) as e:
        check_llama_cpp_version()
    assert "0.3.36" in str(e.value) and "0.2.90" in str(e.value)


def test_version_mismatch_reported_by_register_in_fresh_process() -> None:
    code = ("import llama_cpp; llama_cpp.__version__ = '0.3.99'\n"
            "import pi2_gguf\n"
            "try:\n    pi2_gguf.register()\n"
            "except pi2_gguf.VersionMismatchError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "0.3.99" in out.stdout and "0.3.36" in out.stdout


def test_bad_plugin_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PI2_PLUGIN", str(tmp_path / "libggml-pi2.so"))
    with pytest.raises(PluginError, match="PI2_PLUGIN"):
        plugin_path()


def test_cli_reports_missing_model(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "pi2-gguf"
    out = subprocess.run([str(exe), "run", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "model file not found" in out.stderr and "Traceback" not in out.stderr


def test_cli_reports_truncated_model(smollm2: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(smollm2, cut)
    with cut.open("r+b") as f:
        f.truncate(smollm2.stat().st_size // 3)
    exe = Path(sys.executable).parent / "pi2-gguf"
    out = subprocess.run([str(exe), "run", str(cut)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "truncated" in out.stderr and "Traceback" not in out.stderr
