"""docs/ARCHITECTURE.md is the map of ggml-backend/src/: every source file is in it and every file it names
exists; the build lists every C file; the routing settings are read in graph/route.c only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "ggml-backend" / "src"
MAP = ROOT / "docs" / "ARCHITECTURE.md"


def _mapped_files() -> set[str]:
    """The files the map's table names in its first column: `folder/file`, then `file` in that same folder; a C
    file's row stands for its header too."""
    text = MAP.read_text()
    section = text[text.index("## The map"):text.index("\n## ", text.index("## The map") + 1)]
    files: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                folder = name.rsplit("/", 1)[0] + "/"
                files.add(name)
            else:
                files.add(folder + name)
    return files | {f[:-2] + ".h" for f in files if f.endswith(".c") and (SRC / (f[:-2] + ".h")).is_file()}


def test_map_and_source_folder_agree() -> None:
    on_disk = {str(p.relative_to(SRC)) for p in SRC.rglob("*") if p.is_file() and p.suffix in (".c", ".h")}
    mapped = _mapped_files()
    assert on_disk - mapped == set(), f"source files missing from docs/ARCHITECTURE.md: {sorted(on_disk - mapped)}"
    assert mapped - on_disk == set(), f"docs/ARCHITECTURE.md names files that are not there: {sorted(mapped - on_disk)}"


def test_every_folder_is_a_mechanism_of_the_map() -> None:
    text = MAP.read_text()
    folders = sorted(p.name for p in SRC.iterdir() if p.is_dir())
    assert folders and all(f"**{f}/**" in text for f in folders), folders
    assert sorted(p.name for p in SRC.iterdir() if p.is_file()) == ["ggml-pi2.c"]  # the glue alone at the top


def test_build_lists_every_c_file() -> None:
    cmake = (ROOT / "ggml-backend" / "CMakeLists.txt").read_text()
    listed = set(re.findall(r"^\s+src/(\S+\.c)\s*$", cmake, re.M))
    assert listed == {str(p.relative_to(SRC)) for p in SRC.rglob("*.c")}


def test_routing_settings_are_read_in_the_routing_function_only() -> None:
    readers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.c")
               if re.search(r"PI2_SET_(SPARSE_BATCH|PROMPT)\b", p.read_text())}
    assert readers == {"graph/route.c", "core/config.c"}, readers


def test_glue_is_about_the_size_of_ggml_blas() -> None:
    """ggml-blas.cpp, a whole backend in one file, is ~520 lines; ours holds its interfaces and tables only."""
    assert len((SRC / "ggml-pi2.c").read_text().splitlines()) <= 550
