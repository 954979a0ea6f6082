"""pi2_gguf.Llama: llama_cpp.Llama with the PI2 backend registered first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp

from .gguf_check import check_model_file
from .plugin import register


class Llama(llama_cpp.Llama):
    """Drop-in for llama_cpp.Llama: same arguments; the model's FFN runs in the PI2 backend.

    The model file is validated first, so a missing, non-GGUF or truncated file raises
    pi2_gguf.ModelFileError naming the problem instead of a loader failure."""

    def __init__(self, model_path: str | Path, *args: Any, **kwargs: Any) -> None:
        path = check_model_file(model_path)
        register()
        super().__init__(str(path), *args, **kwargs)
        self._pi2_constructed = True

    def __del__(self) -> None:
        # a Llama rejected before llama_cpp.Llama.__init__ ran has nothing to close
        if getattr(self, "_pi2_constructed", False):
            super().__del__()
