from __future__ import annotations

from pathlib import Path

import pytest

from pi2_gguf import models


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return models.fetch("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return models.fetch("gemma3-270m", progress=False)
