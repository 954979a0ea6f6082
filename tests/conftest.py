from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from pi2_gguf.assets import corpus, models
from pi2_gguf.converter import synthetic
from pi2_gguf.converter.convert import convert
from pi2_gguf.converter.profile import Profile, run_profile

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from settings import RELU_DENSITY, RELU_SHAPE, SMOL_HELDOUT_TOKENS, SMOL_TARGET, SMOL_TRAIN_TOKENS  # noqa: E402

# The tests exercise PI2's own kernels and sparse engine on small SiLU models (SmolLM2, Gemma-3), whose
# layers the default placement (PI2_LAYERS=auto) leaves to ggml-cpu because sparse decode would not be
# faster there: every process the tests start holds every layer instead. tests/test_placement.py sets
# `auto` per model and checks the default.
os.environ["PI2_LAYERS"] = "all"


def _alone(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cached model under a path of its own (a hard link, or a copy across file systems): a sidecar a user
    made beside the cached file (`make run` converts SmolLM2 there) would otherwise be every test's default
    sidecar. Not a symlink to it either: the default sidecar is the one beside the path given, but the cached
    file's directory would still be a place a run could leave one."""
    alone = tmp_path_factory.mktemp("model") / model.name
    try:
        os.link(model, alone)
    except OSError:
        shutil.copyfile(model, alone)
    return alone


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _alone(models.fetch("smollm2-135m", progress=False), tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _alone(models.fetch("gemma3-270m", progress=False), tmp_path_factory)


@pytest.fixture(scope="session")
def smol_profile(smollm2: Path) -> Profile:
    return run_profile(smollm2, corpus.wiki(), SMOL_TRAIN_TOKENS, SMOL_HELDOUT_TOKENS, progress=False)


@pytest.fixture(scope="session")
def smol_sidecar(smollm2: Path, smol_profile: Profile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    prof_path = smol_profile.save(tmp_path_factory.mktemp("profile") / "smol.npz")
    out = tmp_path_factory.mktemp("sidecar") / "smol.pi2.gguf"
    convert(smollm2, out, sparsity=SMOL_TARGET, profile=prof_path, ranks=[64], progress=False)
    return out


@pytest.fixture(scope="session")
def smol_cats_sidecar(smollm2: Path, smol_profile: Profile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same conversion with criterion act (CATS: a threshold on |act(gate)| alone)."""
    prof_path = smol_profile.save(tmp_path_factory.mktemp("profile") / "smol.npz")
    out = tmp_path_factory.mktemp("sidecar") / "smol-cats.pi2.gguf"
    convert(smollm2, out, sparsity=SMOL_TARGET, criterion="act", profile=prof_path, ranks=[64], progress=False,
            perplexity_budget=None)
    return out


@pytest.fixture(scope="session")
def smol_q40_sidecar(smollm2: Path, smol_profile: Profile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's SmolLM2 conversion with its bundles' rows re-quantized from the model's Q4_1 to Q4_0
    (--bundle-type q4_0: 324 instead of 360 bytes a row)."""
    prof_path = smol_profile.save(tmp_path_factory.mktemp("profile") / "smol.npz")
    out = tmp_path_factory.mktemp("sidecar") / "smol-q40.pi2.gguf"
    convert(smollm2, out, sparsity=SMOL_TARGET, profile=prof_path, ranks=[64], progress=False, perplexity_budget=None,
            bundle_type="q4_0")
    return out


@pytest.fixture(scope="session")
def relu_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[synthetic.LayerReport]]:
    """(model, sidecar, measured per-layer density report) of a synthetic ReLU model made by our tools."""
    d = tmp_path_factory.mktemp("relu")
    model = d / "relu.gguf"
    report = synthetic.make(model, RELU_SHAPE, synthetic.Sparsity(density=RELU_DENSITY), "relu", QT.F32,
                            calib_tokens=512, heldout_tokens=256, progress=False)
    sidecar = convert(model, d / "relu.pi2.gguf", train_tokens=2048, heldout_tokens=512, progress=False,
                      perplexity_budget=None).path
    return model, sidecar, report


@pytest.fixture(scope="session")
def tiny_family_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Every family of tests/tiny_families.py in every type, {(family, outtype): GGUF}, converted by llama.cpp's
    converter in one process (needs the `import` extra: its users skip without it). Nothing else is written to
    their directory: a sidecar beside a model would be every later run's default."""
    import tiny_families

    return tiny_families.build_many(list(tiny_families.FAMILIES), tmp_path_factory.mktemp("tiny_families"),
                                    tiny_families.OUTTYPES)

