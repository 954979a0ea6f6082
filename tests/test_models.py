"""Models from PyPI packages: registry, verification."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pi2_gguf.assets import models
from pi2_gguf.converter.model_ffn import ModelFfn
from pi2_gguf.errors import ModelFetchError
from pi2_gguf.gguf_file import check_model_file


def test_unknown_model() -> None:
    with pytest.raises(ModelFetchError, match="unknown model 'llama-70b'"):
        models.fetch("llama-70b")


def test_default_model_is_verified_gguf(smollm2: Path) -> None:
    cached = models.fetch(models.DEFAULT_MODEL, progress=False)  # the smollm2 fixture is a link to it
    assert cached == models.model_path(models.DEFAULT_MODEL)
    assert check_model_file(cached) == cached.resolve()
    assert ModelFfn(smollm2).architecture == "llama"


def test_gemma_is_assembled_from_four_parts(gemma3: Path) -> None:
    spec = models.MODELS["gemma3-270m"]
    assert len(spec.parts) == 4 and gemma3.stat().st_size == spec.size
    assert ModelFfn(gemma3).architecture == "gemma3"


def test_corrupted_cache_entry_is_not_trusted(smollm2: Path, tmp_path: Path) -> None:
    spec = models.MODELS["smollm2-135m"]
    copy = tmp_path / spec.filename
    shutil.copyfile(smollm2, copy)
    assert models._is_verified(spec, copy)
    with copy.open("r+b") as f:
        f.seek(1 << 20)
        f.write(b"\xff" * 16)  # same size, different bytes, new mtime
    assert not models._is_verified(spec, copy)
