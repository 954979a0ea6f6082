"""The plugin's C API is declared once (pi2_gguf.runtime.capi): every function of ggml-pi2.h the Python side
calls has its signature in the table, and every public struct's size is checked against the C side."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from pi2_gguf.errors import PluginError
from pi2_gguf.runtime import capi

HEADER = Path(__file__).resolve().parents[1] / "ggml-backend" / "include" / "ggml-pi2.h"
# exported but not called from Python: ggml finds the registration itself
NOT_CALLED = {"ggml_backend_pi2_reg"}


def test_the_table_covers_the_header() -> None:
    exported = set(re.findall(r"GGML_BACKEND_API[^;(]*?\b(\w+)\s*\(", HEADER.read_text()))
    assert set(capi.SIGNATURES) == exported - NOT_CALLED
    structs = set(re.findall(r"^struct (pi2_\w+) \{", HEADER.read_text(), flags=re.M))
    assert set(capi.STRUCTS) == structs - {"pi2_layer_counters"}  # inside pi2_counters


def test_struct_sizes_match_the_plugin() -> None:
    lib = capi.lib()
    for name, mirror in capi.STRUCTS.items():
        assert lib.pi2_struct_size(name.encode()) == ctypes.sizeof(mirror), name
    assert lib.pi2_struct_size(b"pi2_nothing") == 0


def test_a_struct_of_another_size_asks_for_a_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    class Shorter(ctypes.Structure):
        _fields_ = [(name, kind) for name, kind in capi.Pi2CacheInfo._fields_[:-1]]

    monkeypatch.setitem(capi.STRUCTS, "pi2_cache_info", Shorter)
    with pytest.raises(PluginError, match=r"struct pi2_cache_info is \d+ bytes there and \d+ in this pi2_gguf; "
                                          r"rebuild the plugin"):
        capi._open(capi.plugin_path())


def test_the_library_is_opened_once() -> None:
    assert capi.lib() is capi.lib()
