"""Registration of the plugin into llama-cpp-python's ggml."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp  # noqa: F401  loads the libggml-base.so.0 the plugin links to by soname

import pi2_gguf
from pi2_gguf.runtime import ggml_base
from pi2_gguf.runtime.capi import plugin_path
from pi2_gguf.runtime.plugin import DEVICE_NAME

GGML_BACKEND_DEVICE_TYPE_ACCEL = 3  # enum ggml_backend_dev_type in ggml-backend.h


def test_register_is_idempotent() -> None:
    first = pi2_gguf.register()
    g = ggml_base.registry()
    n = g.ggml_backend_reg_count()
    assert pi2_gguf.register() == first
    assert g.ggml_backend_reg_count() == n  # a second call registers nothing new
    assert pi2_gguf.is_registered()


def test_device_is_accel_in_the_registry_llama_uses() -> None:
    pi2_gguf.register()
    g = ggml_base.registry()
    dev = g.ggml_backend_dev_by_name(DEVICE_NAME.encode())
    assert dev, "PI2 is not in libggml.so.0's registry"
    assert g.ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_ACCEL


def test_build_info_names_pinned_version() -> None:
    lib = ctypes.CDLL(str(plugin_path()))
    lib.pi2_build_info.restype = ctypes.c_char_p
    info = lib.pi2_build_info().decode()
    assert "llama-cpp-python 0.3.36" in info and "ggml api 2" in info


def test_counters_reset(smollm2: Path) -> None:
    llm = pi2_gguf.Llama(str(smollm2), n_ctx=256, n_threads=2, verbose=False)
    llm.eval(llm.tokenize(b"Hello world"))
    assert pi2_gguf.read_counters().matmul_calls.sum() > 0
    pi2_gguf.reset_counters()
    c = pi2_gguf.read_counters()
    assert c.graph_computes == 0 and c.n_layers == 0 and c.matmul_calls.size == 0
    llm.close()
