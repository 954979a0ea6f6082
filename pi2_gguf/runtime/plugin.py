"""The PI2 device in llama-cpp-python's ggml: registration, per-model settings, and the bindings that tie a
model load to its sidecar.

llama-cpp-python never calls ggml_backend_load_all, so the plugin is loaded explicitly through
llama_cpp/lib/libggml.so.0. Not libggml.so: the wheel ships separate copies of each library and the
unversioned one holds a second backend registry that llama never consults.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import ConfigError, MemoryBudgetError, PluginError, SidecarError, VersionMismatchError
from ..llama_build import LLAMA_CPP_PYTHON_VERSION
from . import capi, ggml_base

DEVICE_NAME = "PI2"
MODES = {"dense": 0, "oracle": 1, "predicted": 2}  # enum pi2_mode

_lock = threading.Lock()
_registered: Path | None = None


def check_llama_cpp_version() -> str:
    """Raises VersionMismatchError unless the installed llama-cpp-python is the pinned version."""
    import llama_cpp

    found = getattr(llama_cpp, "__version__", "unknown")
    if found != LLAMA_CPP_PYTHON_VERSION:
        raise VersionMismatchError(
            f"pi2-gguf needs llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (its plugin is compiled against that "
            f"version's ggml), but llama-cpp-python {found} is installed; run tools/bootstrap.py to install "
            f"the pinned build")
    return found


def register() -> Path:
    """Loads the PI2 plugin into llama-cpp-python's ggml (once; later calls do nothing).

    Call before constructing llama_cpp.Llama; pi2_gguf.Llama does it for you."""
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        path = capi.plugin_path()
        check_llama_cpp_version()
        g = ggml_base.registry()
        lib = capi.lib()  # the same loaded library ggml_backend_load gets below
        info = lib.pi2_build_info().decode()
        if f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}" not in info:
            raise VersionMismatchError(f"PI2 plugin {path} was built as '{info}', not for llama-cpp-python "
                                       f"{LLAMA_CPP_PYTHON_VERSION}; rebuild it with tools/bootstrap.py")
        if not g.ggml_backend_reg_by_name(DEVICE_NAME.encode()) and not g.ggml_backend_load(str(path).encode()):
            raise PluginError(f"ggml refused to load the PI2 plugin {path} (see the ggml log above)")
        err = capi.err_buffer()
        if lib.pi2_config_error(err, capi.ERR_LEN) != 0:
            # llama-cpp-python silences stderr while loading (verbose=False): say it here instead
            raise PluginError(f"PI2 plugin: {capi.err_text(err)}")
        _registered = path
        return path


def is_registered() -> bool:
    return _registered is not None


def _require() -> ctypes.CDLL:
    if _registered is None:
        raise PluginError("the PI2 plugin is not registered; call pi2_gguf.register() first")
    return capi.lib()


# --- per-model settings ----------------------------------------------------------------------------

def setting_name(name: str) -> str:
    """"down_sparse_max" or "PI2_DOWN_SPARSE_MAX" -> "PI2_DOWN_SPARSE_MAX"."""
    return name if name.startswith("PI2_") else "PI2_" + name.upper()


def setting_value(value: str | int | float | bool) -> str:
    """The text the plugin parses, as from the environment: True -> "1", 1.0 -> "1.0", 600 -> "600"."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return value if isinstance(value, str) else repr(value)


def configure(name: str, value: str | int | float | bool, binding: int = 0) -> None:
    """Sets a per-model PI2_* setting (docs/SETTINGS.md) for a loaded model's binding, or with binding 0 the
    default every model without its own value follows. name: "down_sparse_max" or "PI2_DOWN_SPARSE_MAX".
    Raises ConfigError (a ValueError) with the plugin's message naming the variable and the value."""
    full = setting_name(name)
    err = capi.err_buffer()
    if _require().pi2_config_set(int(binding), full.encode(), setting_value(value).encode(), err, capi.ERR_LEN) != 0:
        raise ConfigError(capi.err_text(err))


# --- bindings: a model load tied to its sidecar ----------------------------------------------------

def mode_value(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(MODES)}")
    return MODES[mode]


def load_begin(sidecar: str | os.PathLike[str] | None, mode: str, flash: bool = False,
               model: str | os.PathLike[str] | None = None) -> int:
    """Binds the PI2 weight buffers of the next model load to this sidecar and mode (the sidecar is
    opened and checked now). Returns the binding id (0 without a sidecar). Pair with load_end().
    model: the model file: PI2 computes the FFN activation it states (<arch>.ffn_activation), checked
    against the sidecar's. flash: the FFN stays on flash (a memory budget; size the cache with set_budget
    after the load); a token embedding apart from the output matrix then stays in the model file too."""
    err = capi.err_buffer()
    path = None if sidecar is None else os.fsencode(sidecar)
    model_path = None if model is None else os.fsencode(model)
    if flash:
        rc = _require().pi2_load_begin_flash(path, model_path, mode_value(mode), err, capi.ERR_LEN)
    else:
        rc = _require().pi2_load_begin(path, model_path, mode_value(mode), err, capi.ERR_LEN)
    if rc < 0:
        raise SidecarError(capi.err_text(err))
    return int(rc)


def load_end() -> None:
    _require().pi2_load_end()


# Models load one at a time: the plugin ties the weight buffers llama allocates between load_begin and load_end to
# that load's binding (it refuses a second load_begin meanwhile); loads in several threads wait for each other here.
_LOADING = threading.Lock()


@contextlib.contextmanager
def model_load(sidecar: str | os.PathLike[str] | None, mode: str, flash: bool = False,
               model: str | os.PathLike[str] | None = None,
               settings: Mapping[str, str | int | float | bool] | None = None) -> Iterator[int]:
    """The one lifecycle of a model load with PI2 (pi2_gguf.Llama, LlamaRunner, and so serve): the binding opened
    (load_begin's arguments), its settings applied, then the caller loads the model inside the block; load_end
    always follows, and the binding (the id yielded, 0 without a sidecar) is released if the block raises."""
    with _LOADING:
        binding = load_begin(sidecar, mode, flash=flash, model=model)
        try:
            for name, value in (settings or {}).items():
                configure(name, value, binding)
            yield binding
        except BaseException:
            if binding:
                release_binding(binding)
            raise
        finally:
            load_end()


def set_mode(binding: int, mode: str) -> None:
    rc = _require().pi2_binding_set_mode(binding, mode_value(mode))
    if rc == -2:
        left = layers_left(binding)
        raise PluginError(f"mode {mode}: this model's load left FFN layers {_ranges(left)} to ggml-cpu, where they "
                          f"cannot run it; load it with settings={{'layers': 'all'}} (PI2_LAYERS=all) to switch modes "
                          f"on every layer")
    if rc != 0:
        raise PluginError(f"no loaded model has PI2 binding {binding}")


def layers_left(binding: int) -> list[int]:
    """The FFN layers of a loaded model that its load left to ggml-cpu (PI2_LAYERS=auto), ascending."""
    lib = _require()
    n = lib.pi2_binding_layers_left(binding, None, 0)
    if n < 0:
        raise PluginError(f"no loaded model has PI2 binding {binding}")
    out = (ctypes.c_int32 * max(n, 1))()
    n = lib.pi2_binding_layers_left(binding, out, n)
    return list(out[:n])


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[tuple[int, int]] = []
    for k in layers:
        if parts and parts[-1][1] == k - 1:
            parts[-1] = (parts[-1][0], k)
        else:
            parts.append((k, k))
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)


def set_check_recall(binding: int, on: bool) -> None:
    if _require().pi2_binding_set_check_recall(binding, int(on)) != 0:
        raise PluginError(f"no loaded model has PI2 binding {binding}")


def binding_error(binding: int) -> str:
    """Why the binding's last compute failed, or ''."""
    err = capi.err_buffer()
    if _require().pi2_binding_error(binding, err, capi.ERR_LEN) != 0:
        return ""
    return capi.err_text(err)


def set_budget(binding: int, budget: int, reserved: int) -> None:
    """Sizes a flash binding's neuron cache: budget minus this process's resident memory now, minus
    reserved (bytes that will be touched later), minus tables and margin; reads the hot segment.
    Raises MemoryBudgetError stating the minimum when the budget is too small."""
    err = capi.err_buffer()
    if _require().pi2_binding_set_budget(binding, int(budget), int(reserved), err, capi.ERR_LEN) != 0:
        raise MemoryBudgetError(capi.err_text(err))


def inject_read_fault(binding: int, after: int, errno_value: int) -> None:
    """Testing: the bundle read after `after` more reads fails with errno_value."""
    if _require().pi2_binding_inject_read_fault(binding, int(after), int(errno_value)) != 0:
        raise PluginError(f"PI2 binding {binding} has no neuron cache")


INJECT_SHORT_READS = -1  # PI2_INJECT_SHORT_READS


def inject_short_reads(binding: int, requests: int) -> None:
    """Testing: the next `requests` bundle reads are each made of preadv calls of at most 512 bytes."""
    inject_read_fault(binding, requests, INJECT_SHORT_READS)


def release_binding(binding: int) -> None:
    _require().pi2_binding_release(binding)
