"""A script of tools/ loaded as a module, so tests can call its functions and main()."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(name: str, *args: str, timeout: float = 600) -> None:
    """tools/NAME.py run in a process of its own (nothing a test process loaded or changed reaches it); its stderr's
    end in the failure."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
