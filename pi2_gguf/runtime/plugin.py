"""Registration of the PI2 backend plugin into llama-cpp-python's ggml, and its counters.

llama-cpp-python never calls ggml_backend_load_all, so the plugin is loaded explicitly through
llama_cpp/lib/libggml.so.0. Not libggml.so: the wheel ships separate copies of each library and the
unversioned one holds a second backend registry that llama never consults.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFileError, PluginError, SidecarError, VersionMismatchError
from ..llama_build import LLAMA_CPP_PYTHON_VERSION

PLUGIN_FILE = "libggml-pi2.so"
DEVICE_NAME = "PI2"
MAX_LAYERS = 1024  # PI2_MAX_LAYERS in ggml-backend/include/ggml-pi2.h
N_MATRIX = 3       # gate, up, down

_lock = threading.Lock()
_plugin: ctypes.CDLL | None = None
_tools: ctypes.CDLL | None = None
_ERR_LEN = 2048


class _LayerCounters(ctypes.Structure):
    _fields_ = [
        ("matmul_calls", ctypes.c_uint64 * N_MATRIX),
        ("matmul_tokens", ctypes.c_uint64 * N_MATRIX),
        ("rows", ctypes.c_uint64 * N_MATRIX),
        ("weight_bytes", ctypes.c_uint64 * N_MATRIX),
        ("glu_calls", ctypes.c_uint64),
        ("glu_tokens", ctypes.c_uint64),
        ("sparse_tokens", ctypes.c_uint64),
        ("neurons", ctypes.c_uint64),
        ("predicted", ctypes.c_uint64),
        ("active", ctypes.c_uint64),
        ("down_sparse_tokens", ctypes.c_uint64),
        ("checked_tokens", ctypes.c_uint64),
        ("missed", ctypes.c_uint64),
        ("hot_hits", ctypes.c_uint64),
        ("cold_hits", ctypes.c_uint64),
        ("misses", ctypes.c_uint64),
        ("bytes_read", ctypes.c_uint64),
        ("io_requests", ctypes.c_uint64),
        ("io_wait_ns", ctypes.c_uint64),
        ("prefetched", ctypes.c_uint64),
    ]


class _CacheInfo(ctypes.Structure):
    _fields_ = [
        ("fixed_bytes", ctypes.c_uint64),
        ("hot_bytes", ctypes.c_uint64),
        ("cold_bytes", ctypes.c_uint64),
        ("hot_neurons", ctypes.c_uint64),
        ("n_cold", ctypes.c_uint32),
        ("direct_io", ctypes.c_uint32),
        ("freq_cutoff", ctypes.c_float),
        ("n_prefetch", ctypes.c_uint32),
        ("ffn_ns", ctypes.c_uint64),
        ("embd_bytes", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class CacheInfo:
    """The neuron cache of a model with a memory budget: segment sizes (bytes), hot neurons (all layers),
    cold entries, whether reads bypass the page cache, time spent in its FFN layers, the bytes of token
    embedding left in the model file (read per token; 0 when it is in RAM), and the cold entries kept for
    prefetching the next layer's first bundles."""

    fixed_bytes: int
    hot_bytes: int
    cold_bytes: int
    hot_neurons: int
    n_cold: int
    direct_io: bool
    freq_cutoff: float
    ffn_seconds: float
    embedding_bytes: int
    n_prefetch: int


class _Counters(ctypes.Structure):
    _fields_ = [
        ("graph_computes", ctypes.c_uint64),
        ("nodes_computed", ctypes.c_uint64),
        ("n_layers", ctypes.c_uint32),
        ("layer", _LayerCounters * MAX_LAYERS),
    ]


@dataclass(frozen=True)
class Counters:
    """What the PI2 device executed since the last reset (process-wide). Arrays are [layer, matrix]
    with matrix 0 = gate, 1 = up, 2 = down."""

    graph_computes: int
    nodes_computed: int
    n_layers: int
    matmul_calls: np.ndarray
    matmul_tokens: np.ndarray
    rows: np.ndarray
    weight_bytes: np.ndarray
    glu_calls: np.ndarray
    glu_tokens: np.ndarray
    # sparse decode, per layer: tokens decoded sparsely, n_ff summed over them, neurons whose gate was
    # computed, neurons active,
    # tokens whose down ran by columns, tokens with the recall check, active neurons the predictor missed
    sparse_tokens: np.ndarray
    neurons: np.ndarray
    predicted: np.ndarray
    active: np.ndarray
    down_sparse_tokens: np.ndarray
    checked_tokens: np.ndarray
    missed: np.ndarray
    # flash-resident FFN (memory budget), per layer: bundles found in the hot segment, in the cold
    # segment, read from the sidecar; bytes read; read requests; time the threads waited (ns, per thread);
    # of the misses, those read ahead while the layer before finished
    hot_hits: np.ndarray
    cold_hits: np.ndarray
    misses: np.ndarray
    bytes_read: np.ndarray
    io_requests: np.ndarray
    io_wait_ns: np.ndarray
    prefetched: np.ndarray

    def active_per_token(self) -> np.ndarray:
        """Mean active neurons per sparsely decoded token, per layer (nan where none ran sparse)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active.astype(float) / self.sparse_tokens.astype(float)

    def recall(self) -> np.ndarray:
        """Per layer, on checked tokens: active neurons the predictor selected / all active neurons."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active.astype(float) / (self.active + self.missed).astype(float)


MODES = {"dense": 0, "oracle": 1, "predicted": 2}  # enum pi2_mode


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


def plugin_path() -> Path:
    """PI2_PLUGIN if set; else the plugin inside this package; else the one of the installed
    pi2-gguf distribution (when this package is imported from a source checkout)."""
    env = os.environ.get("PI2_PLUGIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise PluginError(f"PI2_PLUGIN={env} is not a file")
        return p
    candidates = [Path(__file__).resolve().parent / "lib" / PLUGIN_FILE]
    try:
        candidates.append(Path(str(importlib.metadata.distribution("pi2-gguf").locate_file(f"pi2_gguf/lib/{PLUGIN_FILE}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    for p in candidates:
        if p.is_file():
            return p
    raise PluginError(f"PI2 plugin {PLUGIN_FILE} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
                      "build it with tools/bootstrap.py")


def _libggml() -> ctypes.CDLL:
    import llama_cpp

    lib = Path(llama_cpp.__file__).resolve().parent / "lib" / "libggml.so.0"
    if not lib.is_file():
        raise PluginError(f"{lib} not found: this llama-cpp-python install has no shared ggml")
    g = ctypes.CDLL(str(lib))
    g.ggml_backend_load.restype = ctypes.c_void_p
    g.ggml_backend_load.argtypes = [ctypes.c_char_p]
    g.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    g.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    return g


def register() -> Path:
    """Loads the PI2 plugin into llama-cpp-python's ggml (once; later calls do nothing).

    Call before constructing llama_cpp.Llama; pi2_gguf.Llama does it for you."""
    global _plugin
    with _lock:
        path = plugin_path()
        if _plugin is not None:
            return path
        check_llama_cpp_version()
        g = _libggml()
        plugin = ctypes.CDLL(str(path))
        plugin.pi2_build_info.restype = ctypes.c_char_p
        plugin.pi2_counters_size.restype = ctypes.c_size_t
        info = plugin.pi2_build_info().decode()
        if f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}" not in info:
            raise VersionMismatchError(f"PI2 plugin {path} was built as '{info}', not for llama-cpp-python "
                                       f"{LLAMA_CPP_PYTHON_VERSION}; rebuild it with tools/bootstrap.py")
        if plugin.pi2_counters_size() != ctypes.sizeof(_Counters):
            raise PluginError(f"PI2 plugin {path} has a different counter layout than this pi2_gguf; rebuild it")
        if not g.ggml_backend_reg_by_name(DEVICE_NAME.encode()):
            if not g.ggml_backend_load(str(path).encode()):
                raise PluginError(f"ggml refused to load the PI2 plugin {path} (see the ggml log above)")
        plugin.pi2_counters_read.argtypes = [ctypes.POINTER(_Counters)]
        plugin.pi2_config_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        plugin.pi2_config_error.restype = ctypes.c_int
        err = ctypes.create_string_buffer(_ERR_LEN)
        if plugin.pi2_config_error(err, _ERR_LEN) != 0:
            # llama-cpp-python silences stderr while loading (verbose=False): say it here instead
            raise PluginError(f"PI2 plugin: {err.value.decode('utf-8', 'replace')}")
        plugin.pi2_load_begin.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        plugin.pi2_load_begin.restype = ctypes.c_int
        plugin.pi2_load_begin_flash.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                                ctypes.c_size_t]
        plugin.pi2_load_begin_flash.restype = ctypes.c_int
        plugin.pi2_binding_set_budget.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                                                  ctypes.c_size_t]
        plugin.pi2_binding_set_budget.restype = ctypes.c_int
        plugin.pi2_binding_cache_info.argtypes = [ctypes.c_int, ctypes.POINTER(_CacheInfo)]
        plugin.pi2_binding_cache_info.restype = ctypes.c_int
        plugin.pi2_binding_inject_read_fault.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
        plugin.pi2_binding_inject_read_fault.restype = ctypes.c_int
        plugin.pi2_load_end.argtypes = []
        plugin.pi2_load_end.restype = None
        for fn in ("pi2_binding_set_mode", "pi2_binding_set_check_recall"):
            getattr(plugin, fn).argtypes = [ctypes.c_int, ctypes.c_int]
            getattr(plugin, fn).restype = ctypes.c_int
        plugin.pi2_binding_error.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        plugin.pi2_binding_error.restype = ctypes.c_int
        plugin.pi2_binding_release.argtypes = [ctypes.c_int]
        plugin.pi2_binding_release.restype = ctypes.c_int
        plugin.pi2_set_sparse_limits.argtypes = [ctypes.c_int, ctypes.c_float]
        plugin.pi2_set_sparse_limits.restype = None
        plugin.pi2_set_prompt_on_cpu.argtypes = [ctypes.c_int]
        plugin.pi2_set_prompt_on_cpu.restype = None
        plugin.pi2_set_model_rows.argtypes = [ctypes.c_int]
        plugin.pi2_set_model_rows.restype = None
        plugin.pi2_set_predictor_always.argtypes = [ctypes.c_int]
        plugin.pi2_set_predictor_always.restype = None
        plugin.pi2_config_set.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        plugin.pi2_config_set.restype = ctypes.c_int
        _plugin = plugin
        return path


def is_registered() -> bool:
    return _plugin is not None


def _require() -> ctypes.CDLL:
    if _plugin is None:
        raise PluginError("the PI2 plugin is not registered; call pi2_gguf.register() first")
    return _plugin


def read_counters() -> Counters:
    raw = _Counters()
    _require().pi2_counters_read(ctypes.byref(raw))
    n = int(raw.n_layers)
    layers = raw.layer[:n]

    def per_matrix(name: str) -> np.ndarray:
        return np.array([list(getattr(lc, name)) for lc in layers], dtype=np.uint64).reshape(n, N_MATRIX)

    return Counters(
        graph_computes=int(raw.graph_computes),
        nodes_computed=int(raw.nodes_computed),
        n_layers=n,
        matmul_calls=per_matrix("matmul_calls"),
        matmul_tokens=per_matrix("matmul_tokens"),
        rows=per_matrix("rows"),
        weight_bytes=per_matrix("weight_bytes"),
        glu_calls=np.array([lc.glu_calls for lc in layers], dtype=np.uint64),
        glu_tokens=np.array([lc.glu_tokens for lc in layers], dtype=np.uint64),
        **{name: np.array([getattr(lc, name) for lc in layers], dtype=np.uint64)
           for name in ("sparse_tokens", "neurons", "predicted", "active", "down_sparse_tokens", "checked_tokens", "missed",
                        "hot_hits", "cold_hits", "misses", "bytes_read", "io_requests", "io_wait_ns", "prefetched")},
    )


def reset_counters() -> None:
    _require().pi2_counters_reset()


def mode_value(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(MODES)}")
    return MODES[mode]


def load_begin(sidecar: str | os.PathLike[str] | None, mode: str, flash: bool = False,
               model: str | os.PathLike[str] | None = None) -> int:
    """Binds the PI2 weight buffers of the next model load to this sidecar and mode (the sidecar is
    opened and checked now). Returns the binding id (0 without a sidecar). Pair with load_end().
    flash: the FFN stays on flash (a memory budget; size the cache with set_budget after the load); with
    the model file named, a token embedding apart from the output matrix stays in that file too."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    path = None if sidecar is None else os.fsencode(sidecar)
    if flash:
        rc = _require().pi2_load_begin_flash(path, None if model is None else os.fsencode(model), mode_value(mode),
                                             err, _ERR_LEN)
    else:
        rc = _require().pi2_load_begin(path, mode_value(mode), err, _ERR_LEN)
    if rc < 0:
        raise SidecarError(err.value.decode("utf-8", "replace"))
    return int(rc)


def load_end() -> None:
    _require().pi2_load_end()


def set_mode(binding: int, mode: str) -> None:
    if _require().pi2_binding_set_mode(binding, mode_value(mode)) != 0:
        raise PluginError(f"no loaded model has PI2 binding {binding}")


def set_check_recall(binding: int, on: bool) -> None:
    if _require().pi2_binding_set_check_recall(binding, int(on)) != 0:
        raise PluginError(f"no loaded model has PI2 binding {binding}")


def binding_error(binding: int) -> str:
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _require().pi2_binding_error(binding, err, _ERR_LEN) != 0:
        return ""
    return err.value.decode("utf-8", "replace")


def set_budget(binding: int, budget: int, reserved: int) -> None:
    """Sizes a flash binding's neuron cache: budget minus this process's resident memory now, minus
    reserved (bytes that will be touched later), minus tables and margin; reads the hot segment.
    Raises MemoryBudgetError stating the minimum when the budget is too small."""
    from ..errors import MemoryBudgetError

    err = ctypes.create_string_buffer(_ERR_LEN)
    if _require().pi2_binding_set_budget(binding, int(budget), int(reserved), err, _ERR_LEN) != 0:
        raise MemoryBudgetError(err.value.decode("utf-8", "replace"))


def cache_info(binding: int) -> CacheInfo | None:
    raw = _CacheInfo()
    if _require().pi2_binding_cache_info(binding, ctypes.byref(raw)) != 0:
        return None
    return CacheInfo(int(raw.fixed_bytes), int(raw.hot_bytes), int(raw.cold_bytes), int(raw.hot_neurons), int(raw.n_cold),
                     bool(raw.direct_io), float(raw.freq_cutoff), raw.ffn_ns / 1e9, int(raw.embd_bytes),
                     int(raw.n_prefetch))


def inject_read_fault(binding: int, after: int, errno_value: int) -> None:
    """Testing: the bundle read after `after` more reads fails with errno_value."""
    if _require().pi2_binding_inject_read_fault(binding, int(after), int(errno_value)) != 0:
        raise PluginError(f"PI2 binding {binding} has no neuron cache")


def release_binding(binding: int) -> None:
    _require().pi2_binding_release(binding)


def configure(name: str, value: str | int | float, binding: int = 0) -> None:
    """Sets a per-model PI2_* setting (docs/SETTINGS.md) for a loaded model's binding, or with binding 0 the
    default every model without its own value follows. Raises ValueError naming the variable and value."""
    full = name if name.startswith("PI2_") else "PI2_" + name.upper()
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _require().pi2_config_set(int(binding), full.encode(), str(value).encode(), err, _ERR_LEN) != 0:
        raise ValueError(err.value.decode("utf-8", "replace"))


def set_sparse_limits(batch_max: int = -1, down_sparse_max: float = -1.0) -> None:
    """Largest decode batch run sparse; active fraction up to which down runs by columns (-1: unchanged)."""
    _require().pi2_set_sparse_limits(int(batch_max), float(down_sparse_max))


# --- the plugin's tool entry points (sidecar reader, fingerprints): no registration into llama needed ---

def _tools_lib() -> ctypes.CDLL:
    """The plugin opened for its sidecar and fingerprint functions (ggml-pi2.h)."""
    global _tools
    with _lock:
        if _tools is not None:
            return _tools
        import llama_cpp  # noqa: F401  loads the libggml-base.so.0 the plugin links to by soname

        path = plugin_path()
        lib = ctypes.CDLL(str(path))
        try:
            lib.pi2_sidecar_validate.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.pi2_sidecar_validate.restype = ctypes.c_int
            lib.pi2_sidecar_summary.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32),
                                                ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_size_t]
            lib.pi2_sidecar_summary.restype = ctypes.c_int
            lib.pi2_sidecar_check_weight.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t,
                                                     ctypes.c_char_p, ctypes.c_size_t]
            lib.pi2_sidecar_check_weight.restype = ctypes.c_int
            lib.pi2_fingerprint_tensor.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                   ctypes.c_size_t]
            lib.pi2_fingerprint_tensor.restype = ctypes.c_uint64
            lib.pi2_fingerprint_model.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            lib.pi2_fingerprint_model.restype = ctypes.c_uint64
            lib.pi2_columns_add.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_void_p]
            lib.pi2_columns_add.restype = ctypes.c_int
            lib.pi2_model_summary.argtypes = [ctypes.c_char_p, ctypes.POINTER(_ModelSummaryC), ctypes.c_char_p,
                                              ctypes.c_size_t]
            lib.pi2_model_summary.restype = ctypes.c_int
        except AttributeError as e:
            raise PluginError(f"PI2 plugin {path} has no sidecar reader ({e}); rebuild it with tools/bootstrap.py") from e
        _tools = lib
        return lib


class _ModelSummaryC(ctypes.Structure):
    _fields_ = [("fingerprint", ctypes.c_uint64), ("ffn_bytes", ctypes.c_uint64), ("embedding_bytes", ctypes.c_uint64),
                ("file_size", ctypes.c_uint64), ("n_tensors", ctypes.c_int64), ("n_layer", ctypes.c_uint32)]


@dataclass(frozen=True)
class ModelSummary:
    """A model file as pi2 sees it before llama loads it (ggml-pi2.h, pi2_model_summary)."""

    fingerprint: int      # of the gated FFN weights (docs/FORMAT.md); 0 without FFN layers
    ffn_bytes: int        # blk.N.ffn_{gate,up,down}.weight, all layers
    embedding_bytes: int  # token_embd.weight when output.weight is a tensor of its own, else 0
    file_size: int
    n_tensors: int
    n_layer: int          # gated FFN layers


def model_summary_c(path: str | os.PathLike[str]) -> ModelSummary:
    """The plugin's reading of a model file: ggml's GGUF reader, so a large vocabulary costs little (gguf-py's
    reader builds Python objects for every token). Raises ModelFileError with its message."""
    out = _ModelSummaryC()
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _tools_lib().pi2_model_summary(os.fsencode(path), ctypes.byref(out), err, _ERR_LEN) != 0:
        raise ModelFileError(err.value.decode("utf-8", "replace"))
    return ModelSummary(*(int(getattr(out, name)) for name, _ in _ModelSummaryC._fields_))


def _raw_bytes(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def validate_sidecar_c(path: str | os.PathLike[str]) -> None:
    """Checks a sidecar with the plugin's C reader; raises SidecarError with its message if it refuses."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _tools_lib().pi2_sidecar_validate(os.fsencode(path), err, _ERR_LEN) != 0:
        raise SidecarError(err.value.decode("utf-8", "replace"))


def sidecar_summary_c(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(pi2.n_layer, pi2.source.fingerprint) of a sidecar the C reader accepts."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    n_layer = ctypes.c_uint32()
    fp = ctypes.c_uint64()
    if _tools_lib().pi2_sidecar_summary(os.fsencode(path), ctypes.byref(n_layer), ctypes.byref(fp), err, _ERR_LEN) != 0:
        raise SidecarError(err.value.decode("utf-8", "replace"))
    return int(n_layer.value), int(fp.value)


def check_sidecar_weight_c(path: str | os.PathLike[str], layer: int, matrix: int, qtype: int, ne0: int, ne1: int,
                           data: np.ndarray | bytes) -> None:
    """Raises SidecarError unless blk.<layer>.ffn_{gate,up,down}.weight (matrix 0, 1, 2) with these bytes is
    the weight the sidecar was made from."""
    raw = _raw_bytes(data)
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _tools_lib().pi2_sidecar_check_weight(os.fsencode(path), layer, matrix, int(qtype), ne0, ne1,
                                             raw.ctypes.data_as(ctypes.c_void_p), raw.nbytes, err, _ERR_LEN) != 0:
        raise SidecarError(err.value.decode("utf-8", "replace"))


def fingerprint_tensor_c(qtype: int, ne0: int, ne1: int, data: np.ndarray | bytes) -> int:
    """The C fingerprint of one FFN weight tensor from its raw bytes (docs/FORMAT.md, "Fingerprint")."""
    raw = _raw_bytes(data)
    return int(_tools_lib().pi2_fingerprint_tensor(int(qtype), ne0, ne1, raw.ctypes.data_as(ctypes.c_void_p), raw.nbytes))


def fingerprint_model_c(tensor_fps: list[int]) -> int:
    """The C model fingerprint over 3 * n_layer tensor fingerprints."""
    arr = (ctypes.c_uint64 * len(tensor_fps))(*tensor_fps)
    return int(_tools_lib().pi2_fingerprint_model(arr, len(tensor_fps)))


def set_model_rows(model: bool) -> None:
    """In RAM, predicted-mode layers without a predictor read gate/up rows from the model's matrices
    (True, the default) or from the sidecar's bundles (False, as oracle mode does)."""
    _require().pi2_set_model_rows(int(model))


def set_predictor_always(always: bool) -> None:
    """Run every layer's predictor in predicted mode, even where it costs more bytes than it saves."""
    _require().pi2_set_predictor_always(int(always))


def set_prompt_on_cpu(on: bool) -> None:
    """Prompt batches in ggml-cpu's kernels (True, the default) or in PI2's dense kernel (False)."""
    _require().pi2_set_prompt_on_cpu(int(on))


def columns_add(qtype: int, y: np.ndarray, a: np.ndarray, columns: np.ndarray) -> None:
    """y += sum of a[c] * column c, in place, by the plugin's down-column kernels, grouped as sparse decode
    groups its active neurons. columns: [n_cols] rows of quantized bytes of y's length each (for tests)."""
    y = np.asarray(y)
    if y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError("y must be a contiguous float32 array")
    a = np.ascontiguousarray(a, dtype=np.float32)
    columns = np.ascontiguousarray(columns, dtype=np.uint8)
    ptrs = (ctypes.c_void_p * len(a))(*[columns[c].ctypes.data for c in range(len(a))])
    if _tools_lib().pi2_columns_add(int(qtype), y.size, y.ctypes.data, len(a), a.ctypes.data, ptrs) != 0:
        raise ValueError(f"no column kernel for type {qtype} and length {y.size}")
