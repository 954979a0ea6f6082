"""The patches mechanism of the llama-cpp-python build: key, application, errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pi2_gguf import llama_build
from pi2_gguf.llama_build import BuildError, apply_patches, build_key, patch_hash, prepare_source

REPO = Path(__file__).resolve().parents[1]
TARGET = "vendor/llama.cpp/src/llama.cpp"


def _patch_adding_line(line: str) -> str:
    """A unified diff that inserts `line` at the top of TARGET (as `diff -u` writes it)."""
    return (f"--- a/{TARGET}\n+++ b/{TARGET}\n@@ -0,0 +1 @@\n+{line}\n")


def test_empty_patches_dir_has_the_empty_hash(tmp_path: Path) -> None:
    assert patch_hash(tmp_path) == hashlib.sha256(b"").hexdigest()[:12]
    assert build_key(tmp_path) == f"{llama_build.LLAMA_CPP_PYTHON_VERSION}-e3b0c44298fc-{llama_build.options_hash()}"


def test_key_follows_build_options() -> None:
    assert llama_build.options_hash("-DLLAVA_BUILD=OFF") != llama_build.options_hash(llama_build.BUILD_CMAKE_ARGS)
    assert len(llama_build.options_hash()) == 8


def test_key_follows_patch_content(tmp_path: Path) -> None:
    (tmp_path / "0001-a.patch").write_text(_patch_adding_line("// one"))
    k1 = patch_hash(tmp_path)
    (tmp_path / "0001-a.patch").write_text(_patch_adding_line("// two"))
    k2 = patch_hash(tmp_path)
    (tmp_path / "README.txt").write_text("not a patch")
    assert k1 != k2 and patch_hash(tmp_path) == k2


def test_missing_patches_dir(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="does not exist"):
        patch_hash(tmp_path / "nope")


def test_repo_patches_apply_to_the_pinned_sdist(tmp_path: Path) -> None:
    src = prepare_source(llama_build.ensure_sdist(), REPO / "patches", dest_parent=tmp_path)
    assert (src / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-backend-impl.h").is_file()
    assert (src.parent / ".complete").read_text().strip() == build_key(REPO / "patches")


def test_nonempty_patches_dir_is_applied(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-marker.patch").write_text(_patch_adding_line("// pi2-gguf test marker"))
    src = prepare_source(llama_build.ensure_sdist(), patches, dest_parent=tmp_path / "src")
    assert (src / TARGET).read_text().splitlines()[0] == "// pi2-gguf test marker"
    assert src.parent.name == build_key(patches)


def test_patch_that_does_not_apply(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-bad.patch").write_text(
        f"--- a/{TARGET}\n+++ b/{TARGET}\n@@ -1,1 +1,1 @@\n-this line is not in the file\n+replacement\n")
    with pytest.raises(BuildError, match="0001-bad.patch does not apply"):
        prepare_source(llama_build.ensure_sdist(), patches, dest_parent=tmp_path / "src")
    assert not list((tmp_path / "src").glob("0.3.36-*"))  # nothing half-made is left as a finished tree


def test_apply_patches_reports_names(tmp_path: Path) -> None:
    root = tmp_path / "tree" / Path(TARGET).parent
    root.mkdir(parents=True)
    (root / "llama.cpp").write_text("x\n")
    patches = tmp_path / "p"
    patches.mkdir()
    (patches / "0002-b.patch").write_text(_patch_adding_line("// b"))
    assert apply_patches(tmp_path / "tree", patches) == ["0002-b.patch"]
