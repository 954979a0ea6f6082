#!/usr/bin/env python3
"""Builds a peer engine, to run beside pi2-gguf in `pi2-gguf bench --peer`, from a source folder you provide.

Peers are not ours and cannot be fetched where the tests run, so neither their sources nor their builds live in
the repository: this script copies the source you give into the cache (PI2_CACHE_DIR, default ~/.cache/pi2-gguf,
under peers/), puts the pinned llama.cpp beside it where the peer builds on llama.cpp's API (the unpatched
vendor/llama.cpp of the llama-cpp-python sdist pi2-gguf builds on; a peer that is a llama.cpp fork keeps its own),
applies our small compatibility patches (patches/peers/), builds, and prints the binary's path. A build is kept
per (peer, source contents, patches, options) and never redone when none changed.

    tools/build_peer.py bmoe --source ~/src/BigMoeOnEdge     # ~10 minutes on 2 cores; prints .../bmoe-cli
    tools/build_peer.py smallthinker --source ~/src/PowerInfer   # ~5 minutes; prints .../bin/llama-cli

Peers (docs/OTHER_ENGINES.md):
  bmoe  BigMoeOnEdge (github.com/Helldez/BigMoeOnEdge, checked at v0.19.0, 2d4f2b1): streams routed experts from
        the stock GGUF with O_DIRECT into an LRU. Its own llama.cpp submodule is a fork; it builds against the
        pinned llama.cpp with bmoe-compat.patch (its MTP glue, for two llama.cpp API renames), and
        bmoe-smallthinker-row.patch lets it stream smallthinker models too.
  smallthinker  SmallThinker's own engine (github.com/SJTU-IPADS/PowerInfer, folder smallthinker/, checked at
        d3ebd7c): a llama.cpp fork that streams Q4_0 experts from an expert bundle (io_uring) into an expert cache;
        built from the fork itself. Needs liburing-dev and libaio-dev. smallthinker-cpufreq-fallback.patch lets it
        run where sysfs has no cpufreq (VMs; without it every streaming run aborts). Its models need ffn_down
        transposed and a bundle: tools/peer_model.py.
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
    llama_dir: str | None       # where the peer expects the pinned llama.cpp's source (None: a fork, its own)
    patches: tuple[str, ...]    # patches/peers/, applied with -p0 at the build root, in order
    cmake: tuple[str, ...]
    target: str
    binary: str                 # relative to the build directory
    root: str = ""              # the folder of the source that is built (the build root; "": the source itself)
    minutes: int = 10           # the build's time on 2 cores, for the log
    needs: tuple[tuple[str, str], ...] = ()  # (a file the build needs on the system, the package that has it)


RECIPES = {
    "bmoe": Recipe(marker="core/src/moe/arch_registry.cpp", llama_dir="third_party/llama.cpp",
                   patches=("bmoe-compat.patch", "bmoe-smallthinker-row.patch"),
                   cmake=("-DCMAKE_BUILD_TYPE=Release", "-DBMOE_BUILD_TESTS=OFF", "-DBMOE_BUILD_CLI=ON"),
                   target="bmoe-cli", binary="cli/bmoe-cli"),
    "smallthinker": Recipe(marker="smallthinker/powerinfer/libaz/az/core/cpu_affinity.cpp", llama_dir=None,
                           root="smallthinker", patches=("smallthinker-cpufreq-fallback.patch",),
                           # its README's Linux options; no perfetto tracing (a submodule), no aarch64 repacking
                           cmake=("-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF",
                                  "-DBUILD_SHARED_LIBS=OFF", "-DAZ_ENABLE_PERFETTO=OFF",
                                  "-DAZ_USE_INTERNAL_PERFETTO=OFF", "-DPOWERINFER_NO_FFN_REPACK=ON",
                                  "-DPOWERINFER_WITH_TRACING=OFF", "-DGGML_CPU_AARCH64=OFF"),
                           target="llama-cli", binary="bin/llama-cli", minutes=5,
                           needs=(("/usr/include/liburing.h", "liburing-dev"),
                                  ("/usr/include/libaio.h", "libaio-dev"))),
}


def _source_hash(source: Path, skip: str | None) -> str:
    """Over the names and contents of the source's files (not .git, not its own llama.cpp folder when skip names it)."""
    h = hashlib.sha256()
    for p in sorted(source.rglob("*")):
        rel = p.relative_to(source).as_posix()
        if not p.is_file() or rel.startswith(".git") or "/.git/" in rel or \
                (skip is not None and (rel == skip or rel.startswith(skip + "/"))):
            continue
        h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _key(name: str, recipe: Recipe, source: Path) -> str:
    h = hashlib.sha256()
    for patch in recipe.patches:
        h.update(patch.encode() + b"\0" + (PATCHES / patch).read_bytes())
    h.update("\0".join(recipe.cmake).encode() + llama_build.LLAMA_CPP_PYTHON_VERSION.encode())
    return f"{name}-{_source_hash(source / recipe.root, recipe.llama_dir)}-{h.hexdigest()[:8]}"


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")


def build(name: str, source: Path, log: Callable[[str], None] = print) -> Path:
    recipe = RECIPES[name]
    if not (source / recipe.marker).is_file():
        raise BuildError(f"{source} is not a {name} source folder (no {recipe.marker})")
    missing = [pkg for path, pkg in recipe.needs if not Path(path).is_file()]
    if missing:
        raise BuildError(f"building {name} needs {' '.join(missing)} (e.g. apt-get install -y {' '.join(missing)})")
    key = _key(name, recipe, source)
    parent = llama_build.cache_dir() / "peers"
    final = parent / key
    binary = final / "build" / recipe.binary
    if (final / ".complete").exists() and binary.is_file():
        return binary
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=parent))
    try:
        root = source / recipe.root
        llama_dir = recipe.llama_dir
        log(f"copying {root}{' and the pinned llama.cpp' if llama_dir is not None else ''} into {final}")
        shutil.copytree(root, tmp, dirs_exist_ok=True, symlinks=True,
                        ignore=lambda d, names: [n for n in names if n == ".git"] +
                        ([Path(llama_dir).name] if llama_dir is not None and Path(d) == root / Path(llama_dir).parent
                         else []))
        if llama_dir is not None:
            sdist = llama_build.ensure_sdist()
            with tempfile.TemporaryDirectory() as no_patches:  # the sdist as published
                pristine = llama_build.prepare_source(sdist, Path(no_patches))
            shutil.copytree(pristine / "vendor" / "llama.cpp", tmp / llama_dir, symlinks=True)
        for patch in recipe.patches:
            _run(["patch", "-p0", "--forward", "--batch", "-i", str(PATCHES / patch)], cwd=tmp)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"building {recipe.target} (about {recipe.minutes} minutes on 2 cores)")
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
