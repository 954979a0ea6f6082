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

import pi2_gguf
from pi2_gguf.errors import ConfigError, MemoryBudgetError
from pi2_gguf.runtime import capi, memory_budget, native, plugin

ROOT = Path(__file__).resolve().parents[1]
PYTHON_ONLY = {"PI2_PLUGIN", "PI2_CACHE_DIR"}

# a value each variable must refuse, and one out of its range where it has a range
MALFORMED = {
    "PI2_SPARSE_BATCH": ["abc", "65", "-1", "4.5"],
    "PI2_DOWN_SPARSE_MAX": ["abc", "1.5", "-0.1", "nan"],
    "PI2_PROMPT": ["gpu", "CPU"],
    "PI2_PREDICTOR": ["sometimes"],
    "PI2_ROWS": ["rows"],
    "PI2_LAYERS": ["some", "ALL"],
    "PI2_IO_THREADS": ["abc", "0", "65"],
    "PI2_IO_ENGINE": ["io_uring", "1"],
    "PI2_IO_INFLIGHT_BYTES": ["2 elephants", "-1MB"],
    "PI2_IO_MAX_BYTES": ["abc", "1", "2GiB"],
    "PI2_IO_GAP": ["32 KB per gap"],
    "PI2_PREFETCH_BYTES": ["8Mi"],
    "PI2_CACHE_MAX": ["600MBs", "lots"],
    "PI2_COLD_SHARE": ["abc", "0.95"],
    "PI2_OUTPUT_ROWS": ["abc", "4097", "-1", "1.5"],
    "PI2_OUTPUT_COPY": ["q4_0", "Q2_K", "2"],
    "PI2_EXPERT_AHEAD": ["abc", "65", "-1", "2.5"],
    "PI2_EXPERT_GUESS": ["on", "ROUTER", "1x"],
    "PI2_EXPERT_READS": ["on", "MODEL", "file"],
    "PI2_BATCH_NEURONS": ["each", "TOKEN", "1"],
    "PI2_DENSE_READS": ["model", "BUNDLES", "0"],
    "PI2_MODE": ["fast"],
    "PI2_MEMORY_BUDGET": ["0", "600 elephants"],
    "PI2_SIDECAR": ["/nonexistent/x.pi2.gguf"],
    "PI2_MODEL": ["/nonexistent/x.gguf"],  # (without PI2_SIDECAR too: it names the model of a sidecar)
}


def _lib() -> ctypes.CDLL:
    return capi.lib()


def _c_names() -> list[str]:
    return native.config_names()


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
        assert out.value == value == native.parse_size(text), text
        if value:  # Python's budgets go through the same parser
            assert memory_budget.parse_size(text) == value
    for text in ("", "MB", "600MBs", "-1", "1e30", "nan", "inf", "6 00MB"):
        assert lib.pi2_parse_size(text.encode(), ctypes.byref(out)) == -1, text
        with pytest.raises(ValueError, match="is not a size"):
            native.parse_size(text)
        with pytest.raises(MemoryBudgetError, match="not a"):
            memory_budget.parse_size(text)


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
        if name in ("PI2_MODE", "PI2_MEMORY_BUDGET", "PI2_SIDECAR", "PI2_MODEL"):  # process settings: environment only
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


def test_configure_takes_either_name_and_python_values() -> None:
    pi2_gguf.register()
    assert plugin.setting_name("down_sparse_max") == plugin.setting_name("PI2_DOWN_SPARSE_MAX") == "PI2_DOWN_SPARSE_MAX"
    assert [plugin.setting_value(v) for v in (True, False, 0.25, 64, "6MiB")] == ["1", "0", "0.25", "64", "6MiB"]
    pi2_gguf.configure("down_sparse_max", 0.25)
    pi2_gguf.configure("PI2_CACHE_MAX", 6 << 20)
    with pytest.raises(ConfigError, match=r"^PI2_DOWN_SPARSE_MAX=2 is not") as e:
        pi2_gguf.configure("down_sparse_max", 2)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ConfigError, match="PI2_NO_SUCH"):
        pi2_gguf.configure("no_such", 1)
    with pytest.raises(ConfigError, match="no loaded model has PI2 binding 12345"):
        pi2_gguf.configure("sparse_batch", 4, binding=12345)
    pi2_gguf.configure("down_sparse_max", 0.2)  # the defaults again (docs/SETTINGS.md)
    pi2_gguf.configure("cache_max", 0)


def test_llama_settings_are_checked_before_the_weights_load(relu_model: tuple[Path, Path, list]) -> None:
    """A refused setting fails the construction with the plugin's message and leaves no binding behind; a
    model's own settings are its binding's, not the defaults'."""
    model, sidecar, _ = relu_model
    with pytest.raises(ConfigError, match=r"PI2_SPARSE_BATCH=65 is not"):
        pi2_gguf.Llama(str(model), sidecar=sidecar, n_ctx=128, verbose=False, settings={"sparse_batch": 65})
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, n_ctx=128, verbose=False, settings={"down_sparse_max": 1.0})
    llm.configure(prompt="pi2", predictor="always")
    with pytest.raises(ConfigError, match="PI2_PROMPT=gpu"):
        llm.configure(prompt="gpu")
    binding = llm.pi2_binding
    llm.close()
    with pytest.raises(ConfigError, match=f"no loaded model has PI2 binding {binding}"):
        pi2_gguf.configure("prompt", "cpu", binding=binding)


def test_python_variables_are_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PI2_PLUGIN and PI2_CACHE_DIR, read by pi2_gguf itself, say their name too."""
    from pi2_gguf import llama_build
    from pi2_gguf.errors import PluginError

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    monkeypatch.setenv("PI2_CACHE_DIR", str(a_file))
    with pytest.raises(llama_build.BuildError, match=f"PI2_CACHE_DIR={a_file} is not a directory"):
        llama_build.cache_dir()
    monkeypatch.setenv("PI2_PLUGIN", str(tmp_path / "missing.so"))
    with pytest.raises(PluginError, match="PI2_PLUGIN=.*missing.so"):
        capi.plugin_path()
