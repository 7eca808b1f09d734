"""The HTTP layer: an OpenAI-compatible ASGI app on Starlette, served by uvicorn.

Why Starlette + uvicorn: the server needs routing, JSON and streamed (server-sent events) responses and
nothing more; Starlette is a small, well-kept ASGI toolkit (FastAPI is built on it) with no dependency beyond
anyio, and uvicorn is the reference ASGI server. Validation lives in `protocol.py` (plain functions, OpenAI's
error shape), so no schema library is needed.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming with `"stream": true`: OpenAI's chunks as
`data: {...}` events, then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Decoding runs in the engine's worker thread; each request gets an asyncio queue that the worker fills through
`loop.call_soon_threadsafe`. A client that disconnects aborts its row (checked while waiting for events).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from eagle_compile.serve.engine import Engine
from eagle_compile.serve.metrics import CONTENT_TYPE
from eagle_compile.serve.protocol import GenerationRequest, RequestError, chunk, error_body, parse_request, response
from eagle_compile.serve.row import Row

POLL_SECONDS = 0.25          # how often a waiting request checks that its client is still there


def create_app(engine: Engine) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _generate(engine, request, "completion")

    async def chat(request: Request) -> Response:
        return await _generate(engine, request, "chat")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "created": 0, "owned_by": "eagle_compile"}]})

    async def health(request: Request) -> Response:
        status = 200 if engine.alive else 503
        return JSONResponse({"status": "ok" if engine.alive else "engine stopped",
                             "waiting": engine.scheduler.waiting, "running": len(engine.running),
                             **engine.describe()}, status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


async def _generate(engine: Engine, http: Request, kind: str) -> Response:
    raw = await http.body()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    try:
        request = parse_request(kind, raw, engine.model_name)
        row = engine.submit(request, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    except RequestError as error:
        engine.metrics.invalid.labels(kind).inc()
        return JSONResponse(error.body(), status_code=error.status)
    if request.stream:
        return StreamingResponse(_stream(http, request, row, queue), media_type="text/event-stream")
    event = await _next_event(http, row, queue)
    if event is None:
        return Response(status_code=499)          # the client is gone; nobody reads this
    if event["type"] == "error":
        return JSONResponse(error_body(event["message"], kind="server_error"), status_code=500)
    return JSONResponse(response(request, event["text"], event["finish_reason"], event["usage"]))


async def _next_event(http: Request, row: Row, queue: asyncio.Queue) -> dict | None:
    """The row's next event; None (and the row aborted) once the client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=POLL_SECONDS)
        except TimeoutError:
            if await http.is_disconnected():
                row.abort()
                return None


async def _stream(http: Request, request: GenerationRequest, row: Row, queue: asyncio.Queue) -> AsyncIterator[str]:
    try:
        if request.kind == "chat":
            yield _sse(chunk(request, "", first=True))
        while True:
            event = await _next_event(http, row, queue)
            if event is None:
                return
            if event["type"] == "delta":
                yield _sse(chunk(request, event["text"]))
                continue
            if event["type"] == "error":
                yield _sse(error_body(event["message"], kind="server_error"))
            else:
                yield _sse(chunk(request, event["rest"], event["finish_reason"]))
                if request.include_usage:
                    yield _sse(chunk(request, None, usage=event["usage"]))
            yield "data: [DONE]\n\n"
            return
    finally:
        if row.finish_reason is None:            # closed early (disconnect, cancelled): free the row
            row.abort()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
