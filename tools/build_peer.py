#!/usr/bin/env python3
"""Builds a peer engine, to run beside pi2-gguf in `pi2-gguf bench --peer`, from a source folder you provide.

Peers are not ours and cannot be fetched where the tests run, so neither their sources nor their builds live in
the repository: this script copies the source you give into the cache (PI2_CACHE_DIR, default ~/.cache/pi2-gguf,
under peers/), puts the pinned llama.cpp beside it (the unpatched vendor/llama.cpp of the llama-cpp-python sdist
pi2-gguf builds on), applies our small compatibility patches (patches/peers/), builds, and prints the binary's
path. A build is kept per (peer, source contents, patches, options) and never redone when none changed.

    tools/build_peer.py bmoe --source ~/src/BigMoeOnEdge     # ~10 minutes on 2 cores; prints .../bmoe-cli

Peers (docs/OTHER_ENGINES.md):
  bmoe  BigMoeOnEdge (github.com/Helldez/BigMoeOnEdge, checked at v0.19.0, 2d4f2b1): streams routed experts from
        the stock GGUF with O_DIRECT into an LRU. Its own llama.cpp submodule is a fork; it builds against the
        pinned llama.cpp with bmoe-compat.patch (its MTP glue, for two llama.cpp API renames), and
        bmoe-smallthinker-row.patch lets it stream smallthinker models too.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pi2_gguf import llama_build  # noqa: E402  (the repository's package, importable before it is installed)
from pi2_gguf.llama_build import BuildError  # noqa: E402

PATCHES = ROOT / "patches" / "peers"


@dataclass(frozen=True)
class Recipe:
    marker: str                 # a file every source folder of this peer has (to refuse a wrong folder early)
    llama_dir: str              # where the peer expects llama.cpp's source
    patches: tuple[str, ...]    # patches/peers/, applied with -p0 at the source root, in order
    cmake: tuple[str, ...]
    target: str
    binary: str                 # relative to the build directory


RECIPES = {
    "bmoe": Recipe(marker="core/src/moe/arch_registry.cpp", llama_dir="third_party/llama.cpp",
                   patches=("bmoe-compat.patch", "bmoe-smallthinker-row.patch"),
                   cmake=("-DCMAKE_BUILD_TYPE=Release", "-DBMOE_BUILD_TESTS=OFF", "-DBMOE_BUILD_CLI=ON"),
                   target="bmoe-cli", binary="cli/bmoe-cli"),
}


def _source_hash(source: Path, skip: str) -> str:
    """Over the names and contents of the source's files (not .git, not its own llama.cpp folder)."""
    h = hashlib.sha256()
    for p in sorted(source.rglob("*")):
        rel = p.relative_to(source).as_posix()
        if not p.is_file() or rel.startswith(".git") or rel == skip or rel.startswith(skip + "/") or "/.git/" in rel:
            continue
        h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _key(name: str, recipe: Recipe, source: Path) -> str:
    h = hashlib.sha256()
    for patch in recipe.patches:
        h.update(patch.encode() + b"\0" + (PATCHES / patch).read_bytes())
    h.update("\0".join(recipe.cmake).encode() + llama_build.LLAMA_CPP_PYTHON_VERSION.encode())
    return f"{name}-{_source_hash(source, recipe.llama_dir)}-{h.hexdigest()[:8]}"


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")


def build(name: str, source: Path, log: Callable[[str], None] = print) -> Path:
    recipe = RECIPES[name]
    if not (source / recipe.marker).is_file():
        raise BuildError(f"{source} is not a {name} source folder (no {recipe.marker})")
    key = _key(name, recipe, source)
    parent = llama_build.cache_dir() / "peers"
    final = parent / key
    binary = final / "build" / recipe.binary
    if (final / ".complete").exists() and binary.is_file():
        return binary
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=parent))
    try:
        log(f"copying {source} and the pinned llama.cpp into {final}")
        shutil.copytree(source, tmp, dirs_exist_ok=True, symlinks=True,
                        ignore=lambda d, names: [n for n in names if n == ".git"] +
                        ([Path(recipe.llama_dir).name] if Path(d) == source / Path(recipe.llama_dir).parent else []))
        sdist = llama_build.ensure_sdist()
        with tempfile.TemporaryDirectory() as no_patches:  # the sdist as published
            pristine = llama_build.prepare_source(sdist, Path(no_patches))
        shutil.copytree(pristine / "vendor" / "llama.cpp", tmp / recipe.llama_dir, symlinks=True)
        for patch in recipe.patches:
            _run(["patch", "-p0", "--forward", "--batch", "-i", str(PATCHES / patch)], cwd=tmp)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"building {recipe.target} (about 10 minutes on 2 cores)")
        # the build directory is made where the tree ends up: CMake records absolute paths
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
        _run(["cmake", "-S", str(final), "-B", str(final / "build"), *gen, *recipe.cmake])
        _run(["cmake", "--build", str(final / "build"), "--target", recipe.target, "-j2"])
        if not binary.is_file():
            raise BuildError(f"the build made no {binary}")
        (final / ".complete").write_text(key + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / ".complete").exists():
            shutil.rmtree(final, ignore_errors=True)
        raise
    return binary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=sorted(RECIPES))
    ap.add_argument("--source", type=Path, required=True, help="the peer's source folder (a checkout or snapshot)")
    args = ap.parse_args()
    try:
        binary = build(args.peer, args.source.resolve(), log=lambda m: print(m, file=sys.stderr))
    except BuildError as e:
        print(f"build_peer: {e}", file=sys.stderr)
        return 1
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
