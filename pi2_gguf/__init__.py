"""pi2-gguf: PowerInfer-2 style FFN execution for stock llama.cpp, as a ggml backend plugin."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, ModelFetchError, ModelFileError, Pi2Error, PluginError, VersionMismatchError
from .llama_build import LLAMA_CPP_PYTHON_VERSION
from .runtime.counters import Counters, read_counters, reset_counters
from .runtime.plugin import configure, is_registered, register

__version__ = "0.1.0"

__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "ConfigError",
    "Counters",
    "Llama",
    "ModelFetchError",
    "ModelFileError",
    "Pi2Error",
    "PluginError",
    "VersionMismatchError",
    "configure",
    "is_registered",
    "read_counters",
    "register",
    "reset_counters",
]


def __getattr__(name: str) -> Any:
    # llama_cpp is imported only when Llama is used, so `import pi2_gguf` stays light and a
    # mismatching llama-cpp-python is reported by register() rather than at import
    if name == "Llama":
        from .runtime.llama import Llama

        return Llama
    raise AttributeError(f"module 'pi2_gguf' has no attribute {name!r}")
