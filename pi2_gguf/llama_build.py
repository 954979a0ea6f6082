"""Build of the pinned llama-cpp-python: sdist download, patches, cached wheel.

Standard library only: tools/bootstrap.py runs it before any virtual environment exists.

The wheel is cached under ~/.cache/pi2-gguf/wheels/<version>-<patch hash>-<options hash>/ and rebuilt only
when the pinned version, the content of patches/*.patch or the build options change. The same patched source tree provides the
ggml headers the PI2 plugin is compiled against, so plugin and wheel always agree.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The multimodal library is not needed and adds minutes to the build. ggml's AMX matmul (compiled in by
# -march=native on CPUs with AMX) crashes with a general protection fault in ggml_backend_amx_mul_mat on
# this machine's Xeon (llama.cpp issue 20824, open), for stock llama.cpp as much as for us: GCC keeps an
# explicit -mno-amx-int8 whatever -march=native enables, so ggml builds without it. Split with shlex, as
# scikit-build-core reads CMAKE_ARGS.
BUILD_CMAKE_ARGS = '-DLLAVA_BUILD=OFF "-DCMAKE_C_FLAGS=-mno-amx-int8" "-DCMAKE_CXX_FLAGS=-mno-amx-int8"'


class BuildError(RuntimeError):
    """The dependency could not be prepared; the message says which step and why."""


def cache_dir() -> Path:
    root = os.environ.get("PI2_CACHE_DIR")
    if root and Path(root).exists() and not Path(root).is_dir():
        raise BuildError(f"PI2_CACHE_DIR={root} is not a directory")
    return Path(root) if root else Path.home() / ".cache" / "pi2-gguf"


def patch_files(patches_dir: Path) -> list[Path]:
    """The patches that apply, in the order they apply (file name order)."""
    if not patches_dir.is_dir():
        raise BuildError(f"patches directory {patches_dir} does not exist")
    return sorted(p for p in patches_dir.iterdir() if p.is_file() and p.suffix == ".patch")


def patch_hash(patches_dir: Path) -> str:
    """12 hex digits over the names and contents of the patches; sha256('')[:12] when there are none."""
    h = hashlib.sha256()
    for p in patch_files(patches_dir):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def options_hash(cmake_args: str = BUILD_CMAKE_ARGS) -> str:
    """8 hex digits over the CMake arguments the wheel is built with."""
    return hashlib.sha256(cmake_args.encode()).hexdigest()[:8]


def build_key(patches_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    return f"{version}-{patch_hash(patches_dir)}-{options_hash()}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_sdist(python: str = sys.executable) -> Path:
    """The pinned sdist in the cache, downloaded from PyPI once and checked against its sha256."""
    target = cache_dir() / "sdist" / SDIST_NAME
    if target.exists() and sha256_file(target) == SDIST_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if res.returncode != 0 or not got.exists():
            raise BuildError(f"could not download {SDIST_NAME} from PyPI:\n{res.stderr[-2000:]}")
        digest = sha256_file(got)
        if digest != SDIST_SHA256:
            raise BuildError(f"{SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}")
        got.replace(target)
    return target


def apply_patches(source_root: Path, patches_dir: Path, strip: int = 1) -> list[str]:
    """Applies every patch of patches_dir, whose paths are relative to the sdist root (-p1 at that root, -p3 at
    its vendor/llama.cpp); returns the names applied."""
    applied = []
    for p in patch_files(patches_dir):
        res = subprocess.run(["patch", f"-p{strip}", "--forward", "--batch", "-d", str(source_root), "-i", str(p)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"patch {patches_dir.name}/{p.name} does not apply to llama-cpp-python "
                             f"{LLAMA_CPP_PYTHON_VERSION}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        applied.append(p.name)
    return applied


def prepare_source(sdist: Path, patches_dir: Path, dest_parent: Path | None = None) -> Path:
    """The unpacked, patched sdist for this build key (kept in the cache; made atomically)."""
    key = build_key(patches_dir)
    parent = dest_parent if dest_parent is not None else cache_dir() / "src"
    final = parent / key
    if (final / ".complete").exists():
        return final / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=parent))
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        root = tmp / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        if not root.is_dir():
            raise BuildError(f"{sdist} does not unpack to {root.name}")
        apply_patches(root, patches_dir)
        (tmp / ".complete").write_text(key + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


@dataclass(frozen=True)
class Dependency:
    key: str
    wheel: Path
    ggml_dir: Path  # ggml headers of the same patched source


def ensure_wheel(patches_dir: Path, python: str = sys.executable, log: Callable[[str], None] = print) -> Dependency:
    """The cached wheel for the current patches, built once (6-18 minutes here) when missing."""
    key = build_key(patches_dir)
    source = prepare_source(ensure_sdist(python), patches_dir)
    wheel_dir = cache_dir() / "wheels" / key
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        log(f"building llama-cpp-python {key} (cached afterwards in {wheel_dir}) ...")
        wheel_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheel_dir.parent, prefix=f".{key}-") as tmp:
            env = dict(os.environ, CMAKE_ARGS=BUILD_CMAKE_ARGS)
            res = subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "-w", tmp, str(source)], env=env)
            built = sorted(Path(tmp).glob("llama_cpp_python-*.whl"))
            if res.returncode != 0 or not built:
                raise BuildError(f"pip wheel of llama-cpp-python {key} failed (exit {res.returncode})")
            staged = Path(tmp) / "out"
            staged.mkdir()
            built[0].replace(staged / built[0].name)
            if wheel_dir.exists():
                shutil.rmtree(wheel_dir)
            staged.replace(wheel_dir)
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    return Dependency(key=key, wheel=wheels[0], ggml_dir=source / "vendor" / "llama.cpp" / "ggml")


def ensure_stock_site(python: str = sys.executable, log: Callable[[str], None] = print) -> Path:
    """llama-cpp-python as a user builds it, without patches/ (its own cached wheel), unpacked into a
    directory that, first on PYTHONPATH, makes `import llama_cpp` load it: the build the plugin must be
    right on by itself. Its ggml is the pinned sdist's, as the patched wheel's, so the plugin loads into it."""
    with tempfile.TemporaryDirectory() as empty:
        dep = ensure_wheel(Path(empty), python, log)
    site = cache_dir() / "stock-site" / dep.key
    if (site / ".complete").is_file():
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dep.key}-", dir=site.parent))
    try:
        import zipfile

        with zipfile.ZipFile(dep.wheel) as z:
            z.extractall(tmp)
        for lib in (tmp / "llama_cpp" / "lib").glob("*.so*"):
            lib.chmod(0o755)  # zip members lose their mode
        (tmp / ".complete").write_text(dep.key + "\n")
        if site.exists():
            shutil.rmtree(site)
        tmp.replace(site)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return site


# llama.cpp's own tools, built on request (tools/bootstrap.py --with-tools, `make tools`) from the same patched
# source as the wheel plus patches/tools/ (changes to llama.cpp's common library, which the wheel does not
# contain), with shared libraries: at run time they use the wheel's libllama and libggml (LD_LIBRARY_PATH set
# by a launcher in the venv; no RPATH), so a process holds one copy of ggml and the plugin loads into it.
TOOL_TARGETS = ("llama-server", "llama-cli", "llama-completion", "llama-bench")
TOOLS_CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_SKIP_RPATH=ON",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                    "-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8")


def tools_key(patches_dir: Path) -> str:
    """The wheel's key plus 8 hex digits over patches/tools/*.patch and the tools' CMake arguments."""
    h = hashlib.sha256("\0".join(TOOLS_CMAKE_ARGS).encode() + b"\0" + ",".join(TOOL_TARGETS).encode())
    tool_patches = patches_dir / "tools"
    for p in patch_files(tool_patches) if tool_patches.is_dir() else []:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return f"{build_key(patches_dir)}-tools-{h.hexdigest()[:8]}"


def ensure_tools(patches_dir: Path, python: str = sys.executable, log: Callable[[str], None] = print) -> Path:
    """The cached build of llama.cpp's tools for the current patches: a directory with bin/ (the tools) and
    lib/ (libraries the wheel does not ship, libmtmd). Built once (about 10 minutes here) when missing."""
    key = tools_key(patches_dir)
    final = cache_dir() / "tools" / key
    if (final / ".complete").is_file():
        return final
    source = prepare_source(ensure_sdist(python), patches_dir) / "vendor" / "llama.cpp"
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake is not on PATH (it builds llama.cpp's tools)")
    final.parent.mkdir(parents=True, exist_ok=True)
    log(f"building llama.cpp tools {key} (cached afterwards in {final}) ...")
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        src = tmp / "src"
        shutil.copytree(source, src, symlinks=True)
        if (patches_dir / "tools").is_dir():
            apply_patches(src, patches_dir / "tools", strip=3)  # src is the sdist's vendor/llama.cpp
        build = tmp / "build"
        for cmd in ([cmake, "-S", str(src), "-B", str(build), *TOOLS_CMAKE_ARGS],
                    [cmake, "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TOOL_TARGETS]):
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise BuildError(f"{' '.join(cmd[:3])} ... failed (exit {res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        out = tmp / "out"
        (out / "bin").mkdir(parents=True)
        (out / "lib").mkdir()
        for t in TOOL_TARGETS:
            shutil.copy2(build / "bin" / t, out / "bin" / t)
        for lib in (build / "bin").glob("lib*.so*"):
            # libllama and libggml* come from the wheel at run time
            if not (lib.name.startswith("libggml") or lib.name.split(".so")[0] == "libllama"):
                shutil.copy2(lib, out / "lib" / lib.name, follow_symlinks=True)
        (out / ".complete").write_text(key + "\n")
        if final.exists():
            shutil.rmtree(final)
        out.replace(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_tool_launchers(tools_dir: Path, bin_dir: Path, wheel_lib_dir: Path) -> list[Path]:
    """Launchers in bin_dir (the venv's bin) that run each tool with the wheel's libraries first on
    LD_LIBRARY_PATH; written atomically. Returns their paths."""
    written = []
    for t in TOOL_TARGETS:
        text = ("#!/bin/sh\n"
                "# llama.cpp's " + t + " from pi2-gguf's build (tools/bootstrap.py --with-tools), run on the\n"
                "# llama-cpp-python wheel's libllama and libggml so the PI2 plugin (GGML_BACKEND_PATH) shares them\n"
                f"LD_LIBRARY_PATH='{wheel_lib_dir}:{tools_dir / 'lib'}'\"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"\n"
                "export LD_LIBRARY_PATH\n"
                f"exec '{tools_dir / 'bin' / t}' \"$@\"\n")
        target = bin_dir / t
        tmp = target.with_name(f".{t}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(target)
        written.append(target)
    return written
