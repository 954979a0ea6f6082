"""`pi2-gguf serve`: llama-cpp-python's OpenAI-compatible server (llama_cpp.server: /v1/completions,
/v1/chat/completions with the GGUF's chat template, streaming) with the model loaded as pi2_gguf.Llama, so
its FFN runs in PI2 with the sidecar, mode and memory budget given here.

llama_cpp.server builds its model with `llama_cpp.Llama(**settings)` when the app is created; for that one
call the name is bound to pi2_gguf.Llama with our arguments (a drop-in: same parameters), so everything
else (settings, chat formats, locking of concurrent requests) is the server's own."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MissingExtraError, Pi2Error
from .runtime.memory_budget import N_BATCH as BUDGET_N_BATCH
from .runtime.memory_budget import parse_size

SERVER_MODULES = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass(frozen=True)
class ServeConfig:
    model: Path
    sidecar: Path | None = None
    mode: str | None = None
    memory_budget: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    n_ctx: int = 2048
    threads: int | None = None
    chat_format: str | None = None


@contextlib.contextmanager
def _llama_class_is(factory: Any) -> Iterator[None]:
    import llama_cpp

    saved = llama_cpp.Llama
    setattr(llama_cpp, "Llama", factory)  # setattr: mypy refuses assigning to a class name
    try:
        yield
    finally:
        setattr(llama_cpp, "Llama", saved)


class JsonBodyGuard:
    """ASGI middleware: a POST whose body is not a JSON object, or not a valid request of the endpoint's own
    schema (llama_cpp.server.types), gets 400 with an OpenAI-style error. Without it llama_cpp.server
    answers 500 to both (its route class turns validation errors into internal errors, and its error
    handler parses the body again and fails on bad JSON)."""

    def __init__(self, app: Any) -> None:
        from llama_cpp.server import types
        from pydantic import BaseModel

        self.app = app
        self.schemas: dict[str, type[BaseModel]] = {"/v1/completions": types.CreateCompletionRequest,
                        "/v1/chat/completions": types.CreateChatCompletionRequest,
                        "/v1/embeddings": types.CreateEmbeddingRequest}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        import pydantic

        try:
            obj = json.loads(body)
            ok, why = isinstance(obj, dict), "the request body is not a JSON object"
            schema = self.schemas.get(scope["path"])
            if ok and schema is not None:
                schema.model_validate(obj)
        except pydantic.ValidationError as e:
            ok, why = False, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        except (ValueError, UnicodeDecodeError) as e:
            ok, why = False, f"the request body is not valid JSON ({e})"
        if not ok:
            payload = json.dumps({"error": {"message": why, "type": "invalid_request_error"}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the disconnect the server's stream waits for

        await self.app(scope, replay, send)


def check_server_extra() -> None:
    import importlib.util

    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"pi2-gguf serve needs llama-cpp-python's server extra ({', '.join(missing)} "
                                "missing): pip install 'llama-cpp-python[server]==0.3.36' (make setup installs it)")


def check_listen(host: str, port: int) -> None:
    """Refuses, before the model loads, a host that does not resolve or an address this process cannot listen
    on (in use, not one of this machine's, a privileged port)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise Pi2Error(f"--host {host}: cannot be resolved ({getattr(e, 'strerror', None) or e})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise Pi2Error(f"cannot listen on {host}:{port} (--host/--port): {e.strerror or e}") from None


def build_app(cfg: ServeConfig) -> tuple[Any, Any]:
    """The server's app (llama_cpp.server's FastAPI app behind JsonBodyGuard) with the model loaded through
    PI2, and that model (a pi2_gguf.Llama)."""
    check_server_extra()
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from .runtime.llama import Llama

    if not 1 <= cfg.port <= 65535:
        raise Pi2Error(f"--port {cfg.port}: not a TCP port (1-65535)")
    if cfg.n_ctx < 1:
        raise Pi2Error(f"--n-ctx {cfg.n_ctx}: must be at least 1")
    if cfg.memory_budget is not None:
        parse_size(cfg.memory_budget, "--memory-budget")  # a malformed size is refused before anything loads
    from .gguf_file import check_context, check_model_file

    check_context(check_model_file(cfg.model), cfg.n_ctx, "--n-ctx")  # a bad model file is the first thing said
    check_listen(cfg.host, cfg.port)
    threads = cfg.threads or os.cpu_count() or 1
    ms: dict[str, Any] = {"model": str(cfg.model), "n_ctx": cfg.n_ctx, "n_threads": threads,
                          "n_threads_batch": threads, "chat_format": cfg.chat_format, "verbose": False}
    if cfg.memory_budget is not None:
        # the FFN stays on flash: no mmap, llama's compute buffers sized for prompt batches of
        # BUDGET_N_BATCH, and no logits kept for every position (the server's default logits_all holds
        # n_ctx x n_vocab floats, 100 MB for SmolLM2 at n_ctx 512, for the `logprobs` option, which then
        # is refused)
        ms.update(use_mmap=False, n_batch=BUDGET_N_BATCH, n_ubatch=BUDGET_N_BATCH, logits_all=False)
    factory = functools.partial(Llama, sidecar=cfg.sidecar, mode=cfg.mode, memory_budget=cfg.memory_budget)

    with _llama_class_is(factory):
        app = server_app.create_app(server_settings=ServerSettings(host=cfg.host, port=cfg.port),
                                    model_settings=[ModelSettings(**ms)])
    proxy = server_app._llama_proxy
    assert proxy is not None  # create_app sets it
    llm = proxy()  # the default model, loaded by create_app
    return JsonBodyGuard(app), llm


def describe(cfg: ServeConfig, llm: Any) -> str:
    mode = llm.pi2_mode
    sidecar = f"sidecar {llm.pi2_sidecar}" if llm.pi2_sidecar else "no sidecar"
    budget = (f"memory budget {llm.pi2_memory_budget / 1e6:.0f} MB (FFN on flash)" if llm.pi2_memory_budget
              else "no memory budget (all in RAM)")
    return (f"pi2-gguf serve: {cfg.model.name} through PI2, mode {mode}, {sidecar}, {budget}\n"
            f"OpenAI-compatible API at http://{cfg.host}:{cfg.port}/v1 (chat: /v1/chat/completions, "
            f"completions: /v1/completions, docs: http://{cfg.host}:{cfg.port}/docs)")


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    app, llm = build_app(cfg)
    print(describe(cfg, llm), flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    return 0

