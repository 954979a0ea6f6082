"""`pi2-gguf serve`: llama-cpp-python's OpenAI-compatible server with the model through PI2, over real HTTP on
127.0.0.1 with the `openai` client. Every server a test starts is stopped by the test (ServerProcess)."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

import pi2_gguf
from pi2_gguf.sidecar import format as fmt

MESSAGES = [{"role": "user", "content": "Name three colors and say why the sky is blue."}]
PROMPT = "The history of the Roman Empire"
N = 32
BUDGET = 300_000_000  # SmolLM2 (98 MB file) with the server's own ~100 MB of Python around it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@contextmanager
def server(cmd: list[str], port: int, log: Path, timeout: float = 180,
           env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Starts cmd (a server listening on port), waits until /v1/models answers, stops it afterwards."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if _request(port, "GET", "/v1/models")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() - t0 > timeout:
                raise AssertionError(f"server did not answer within {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)


def _texts(port: int) -> tuple[str, str]:
    """(chat completion, streamed completion) at temperature 0."""
    c = _client(port)
    chat = c.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=N)
    stream = c.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=N, stream=True)
    return chat.choices[0].message.content or "", "".join(ch.choices[0].text for ch in stream)


def _serve_cmd(model: Path, port: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "pi2_gguf.cli", "serve", str(model), "--port", str(port), "-t", "2",
            "--n-ctx", "512", *more]


def test_dense_serve_equals_stock_server(smollm2: Path, tmp_path: Path) -> None:
    port = _free_port()
    with server(_serve_cmd(smollm2, port, "--mode", "dense"), port, tmp_path / "pi2.log"):
        ours = _texts(port)
    assert "through PI2, mode dense" in (tmp_path / "pi2.log").read_text()
    port = _free_port()
    stock_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2), "--port", str(port),
                 "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "512"]
    with server(stock_cmd, port, tmp_path / "stock.log"):
        stock = _texts(port)
    assert ours == stock
    assert all(len(t) > 10 for t in ours), ours


def test_predicted_serve_equals_in_process(smollm2: Path, smol_sidecar: Path, tmp_path: Path) -> None:
    port = _free_port()
    with server(_serve_cmd(smollm2, port, "--sidecar", str(smol_sidecar), "--mode", "predicted"), port,
                tmp_path / "pi2.log"):
        ours = _texts(port)
    from llama_cpp.server.types import repeat_penalty_field

    # the server's sampling defaults for what an OpenAI request does not set (temperature 0: the rest of the
    # sampler chain keeps the most likely token, after the repeat penalty)
    same = {"temperature": 0, "max_tokens": N, "repeat_penalty": repeat_penalty_field.default}
    llm = pi2_gguf.Llama(str(smollm2), sidecar=smol_sidecar, mode="predicted", n_ctx=512, n_threads=2,
                         n_threads_batch=2, verbose=False)
    try:
        chat = llm.create_chat_completion(messages=MESSAGES, **same)
        llm.reset()
        text = llm.create_completion(PROMPT, **same)
    finally:
        llm.close()
    assert ours == (chat["choices"][0]["message"]["content"], text["choices"][0]["text"])


def test_concurrent_requests_within_the_budget(smollm2: Path, smol_sidecar: Path, tmp_path: Path) -> None:
    """4 requests of 64 tokens at once (the server answers them in turn), the server's RSS sampled every
    100 ms: all complete, and the process never exceeds its memory budget."""
    port = _free_port()
    cmd = _serve_cmd(smollm2, port, "--sidecar", str(smol_sidecar), "--memory-budget", str(BUDGET))
    with server(cmd, port, tmp_path / "pi2.log") as proc:
        assert "memory budget 300 MB (FFN on flash)" in (tmp_path / "pi2.log").read_text()
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss(proc.pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        results: list = [None] * 4

        def ask(i: int) -> None:
            results[i] = _client(port).completions.create(model="m", prompt=f"Story number {i}: once upon a time",
                                                          temperature=0, max_tokens=64)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(600)
        done.set()
        sampler.join()
    for r in results:
        assert r is not None and r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens == 64 or r.choices[0].finish_reason == "stop"
    assert 0 < peak[0] <= BUDGET, peak[0]


def test_bad_requests_and_a_dropped_stream(smollm2: Path, tmp_path: Path) -> None:
    port = _free_port()
    with server(_serve_cmd(smollm2, port, "--mode", "dense"), port, tmp_path / "pi2.log"):
        first = _client(port).completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=16)
        assert 400 <= _request(port, "POST", "/v1/completions", b"{not json")[0] < 500
        assert 400 <= _request(port, "POST", "/v1/chat/completions", b'{"messages": "not a list"}')[0] < 500
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": PROMPT, "max_tokens": 200, "stream": True, "temperature": 0}))
        r = conn.getresponse()
        assert r.status == 200 and r.read(5) == b"data:"
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away after the first event
        conn.close()
        again = _client(port).completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=16)
        assert again.choices[0].text == first.choices[0].text


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "40MB"], "memory budget"),
    (["--memory-budget", "12XB"], "--memory-budget"),
    (["--port", "70000"], "not a TCP port"),
])
def test_serve_refuses_bad_settings_at_load(smollm2: Path, smol_sidecar: Path, args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "pi2_gguf.cli", "serve", str(smollm2), "--sidecar", str(smol_sidecar), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr


def test_demo_converts_once_then_runs_within_the_budget(smollm2: Path, tmp_path: Path) -> None:
    """`make run`'s command on a small model: its sidecar made once beside it, then stock and pi2 (FFN on flash
    under the budget) under the same limit; the second run reuses the sidecar."""
    import shutil

    model = tmp_path / smollm2.name
    shutil.copyfile(smollm2, model)
    cmd = [sys.executable, "-m", "pi2_gguf.cli", "demo", str(model), "-n", "16", "--memory-limit", "200MB"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "converted now" in first.stdout and (tmp_path / (model.stem + ".pi2.gguf")).is_file()
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0 and "(cached" in second.stdout
    assert "NOT larger than" in second.stdout  # SmolLM2 (98 MB) fits 200 MB: the screen says so
    row = next(line for line in second.stdout.splitlines() if line.startswith("| pi2, predicted"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0
    assert int(cells[4].split()[0]) <= 200 and "(limit 200 MB)" in cells[4]  # peak memory within the limit
    assert float(cells[5].split()[0]) > 0  # bytes read from disk per token (the sidecar's bundles)
    assert any(line.startswith("| stock llama.cpp") for line in second.stdout.splitlines())
    from pi2_gguf.demo import DEMO_PROMPT

    assert "pi2's text: " + DEMO_PROMPT in second.stdout and "stock llama.cpp's text: " + DEMO_PROMPT in second.stdout
    # a cached sidecar of an earlier format version (an older pi2-gguf made it) is made again, not an error
    made = tmp_path / (model.stem + ".pi2.gguf")
    data = bytearray(made.read_bytes())
    key = b"pi2.format_version"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, fmt.FORMAT_VERSION)  # GGUF type UINT32, this version
    struct.pack_into("<I", data, at + 4, fmt.FORMAT_VERSION - 1)
    made.write_bytes(bytes(data))
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"format version {fmt.FORMAT_VERSION - 1}" in third.stdout and "converted now" in third.stdout
