"""Model parameters llama_cpp.Llama does not expose as arguments.

Llama builds its llama_model_params from llama_model_default_params() inside __init__; the
context manager below adjusts the defaults for the Llama objects constructed inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import llama_cpp.llama_cpp as llama_lib


@contextlib.contextmanager
def model_params_override(**fields: Any) -> Iterator[None]:
    """e.g. model_params_override(use_extra_bufts=False): stock llama.cpp without CPU weight
    repacking, as `llama-bench --repack 0` runs it."""
    original = llama_lib.llama_model_default_params

    def patched() -> llama_lib.llama_model_params:
        params = original()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    llama_lib.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_lib.llama_model_default_params = original
