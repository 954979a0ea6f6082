"""Every PI2_* variable: declared once in the plugin's table, listed in docs/SETTINGS.md, and refused by
name when malformed or out of range, from the environment and through the API."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pi2_gguf import plugin

ROOT = Path(__file__).resolve().parents[1]
PYTHON_ONLY = {"PI2_PLUGIN", "PI2_CACHE_DIR"}

# a value each variable must refuse, and one out of its range where it has a range
MALFORMED = {
    "PI2_SPARSE_BATCH": ["abc", "65", "-1", "4.5"],
    "PI2_DOWN_SPARSE_MAX": ["abc", "1.5", "-0.1", "nan"],
    "PI2_PROMPT": ["gpu", "CPU"],
    "PI2_PREDICTOR": ["sometimes"],
    "PI2_ROWS": ["rows"],
    "PI2_IO_THREADS": ["abc", "0", "65"],
    "PI2_IO_INFLIGHT_BYTES": ["2 elephants", "-1MB"],
    "PI2_IO_MAX_BYTES": ["abc", "1", "2GiB"],
    "PI2_IO_GAP": ["32 KB per gap"],
    "PI2_PREFETCH_BYTES": ["8Mi"],
    "PI2_CACHE_MAX": ["600MBs", "lots"],
    "PI2_COLD_SHARE": ["abc", "0.95"],
    "PI2_MODE": ["fast"],
    "PI2_MEMORY_BUDGET": ["0", "600 elephants"],
    "PI2_SIDECAR": ["/nonexistent/x.pi2.gguf"],
}


def _lib() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  loads the libggml-base.so.0 the plugin links to

    lib = ctypes.CDLL(str(plugin.plugin_path()))
    lib.pi2_config_names.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.pi2_config_set.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.pi2_parse_size.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]
    return lib


def _c_names() -> list[str]:
    buf = ctypes.create_string_buffer(4096)
    assert _lib().pi2_config_names(buf, len(buf)) == 0
    return buf.value.decode().split(",")


def _doc_names() -> list[str]:
    text = (ROOT / "docs" / "SETTINGS.md").read_text()
    return re.findall(r"^\| `(PI2_[A-Z_]+)` \|", text, flags=re.M)


def test_docs_list_every_variable_once() -> None:
    docs = _doc_names()
    assert len(docs) == len(set(docs))
    assert set(docs) == set(_c_names()) | PYTHON_ONLY
    assert set(MALFORMED) == set(_c_names())


def test_sizes_parse_alike_everywhere() -> None:
    lib = _lib()
    out = ctypes.c_uint64()
    for text, value in (("600MB", 600_000_000), ("1GiB", 1 << 30), ("1.5GB", 1_500_000_000), ("512KiB", 524288),
                        ("1500000000", 1_500_000_000), ("2 gib", 2 << 30), ("0", 0)):
        assert lib.pi2_parse_size(text.encode(), ctypes.byref(out)) == 0, text
        assert out.value == value, text
    for text in ("", "MB", "600MBs", "-1", "1e30", "nan", "inf", "6 00MB"):
        assert lib.pi2_parse_size(text.encode(), ctypes.byref(out)) == -1, text


def _register_with(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "import pi2_gguf\npi2_gguf.register()\nprint('REGISTERED')\n"
    full = {k: v for k, v in os.environ.items() if not k.startswith("PI2_") or k == "PI2_PLUGIN"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_environment_value_is_refused_by_name(name: str) -> None:
    for value in MALFORMED[name]:
        r = _register_with({name: value})
        assert r.returncode != 0 and "REGISTERED" not in r.stdout, (name, value)
        assert f"{name}" in r.stderr and value in r.stderr, (name, value, r.stderr[-1500:])


def test_well_formed_environment_values_register() -> None:
    # PI2_CACHE_MAX=600MB used to mean 600 bytes (read with strtoull), PI2_IO_THREADS=abc 32 threads
    r = _register_with({"PI2_CACHE_MAX": "600MB", "PI2_IO_THREADS": "8", "PI2_COLD_SHARE": "0.5", "PI2_PROMPT": "pi2",
                        "PI2_IO_INFLIGHT_BYTES": "0", "PI2_SPARSE_BATCH": "", "PI2_MODE": "dense"})
    assert r.returncode == 0 and "REGISTERED" in r.stdout, r.stderr[-1500:]


def test_api_values_are_checked_like_the_environment() -> None:
    lib = _lib()
    err = ctypes.create_string_buffer(512)
    for name, values in MALFORMED.items():
        if name in ("PI2_MODE", "PI2_MEMORY_BUDGET", "PI2_SIDECAR"):  # process settings: environment only
            assert lib.pi2_config_set(0, name.encode(), b"x", err, len(err)) == -1
            assert "not a per-model PI2 setting" in err.value.decode()
            continue
        for value in values:
            assert lib.pi2_config_set(0, name.encode(), value.encode(), err, len(err)) == -1, (name, value)
            assert err.value.decode().startswith(f"{name}={value} is not"), err.value
    assert lib.pi2_config_set(0, b"PI2_CACHE_MAX", b"600MB", err, len(err)) == 0
    assert lib.pi2_config_set(0, b"PI2_CACHE_MAX", b"0", err, len(err)) == 0
    assert lib.pi2_config_set(12345, b"PI2_SPARSE_BATCH", b"4", err, len(err)) == -1
    assert "no loaded model has PI2 binding 12345" in err.value.decode()
