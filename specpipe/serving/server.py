"""The OpenAI-compatible HTTP server over a pipeline's batch engine (`python run.py task=serve`).

A thin ASGI layer (FastAPI, uvicorn): a handler checks the request's fields, submits it to the pipeline's batch
engine (its preparation, retrieval included, runs on the engine's thread) and reads its steps as they are
committed (`RequestHandle.asteps`). uvicorn runs in a thread of its own; the main thread runs the engine
(specpipe.serving.scheduler says why). SIGTERM or Ctrl-C: new requests get 503, those running finish for up to
`grace_seconds`, the rest are cancelled, the process exits 0.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specpipe.errors import InvalidRequest, SpecpipeError
from specpipe.pipelines.pipeline import GenerationStats, IncrementalText, Pipeline
from specpipe.serving.handle import Cancelled, RequestHandle
from specpipe.serving.metrics import ServerMetrics
from specpipe.serving.openai_api import (ApiError, ApiRequest, StopTrimmer, chunk, completion_id, finish_reason,
                                         parse_request, response, speculation_stats, usage_chunk)
from specpipe.serving.scheduler import Overloaded

log = logging.getLogger(__name__)
API_KEY_ENVIRONMENT = "SPECPIPE_API_KEY"


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0 = any free port (printed)
    api_key: str | None = None  # every /v1 request then needs `Authorization: Bearer <key>`
    model_name: str | None = None  # the name clients ask for (default: the model's config name)
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256  # a request without max_tokens
    grace_seconds: float = 30.0  # on SIGTERM: how long running requests may finish


class Server:
    """The app and its state: the pipeline, the settings, the metrics, and whether it is draining."""

    def __init__(self, pipeline: Pipeline, settings: ServeSettings) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.model = settings.model_name or pipeline.target.name
        self.metrics = ServerMetrics(prefix_caching=pipeline.decoder.prefix_cache is not None)
        pipeline.scheduler.observer = self.metrics
        self.draining = False
        self.app = self._app()

    # ---- the ASGI app ------------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(title="specpipe", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(BodyLimit, limit=self.settings.max_body_bytes)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError):
            if error.status != 404 or request.url.path.startswith("/v1/"):
                self.metrics.rejected()
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

        @app.get("/health")
        async def health():
            if self.draining:
                raise ApiError(503, "the server is shutting down", kind="service_unavailable")
            return {"status": "ok", "model": self.model, "pipeline": self.pipeline.name}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": int(time.time()),
                                                "owned_by": "specpipe"}]}

        async def serve(request: Request, chat: bool):
            self._authorize(request)
            if self.draining:
                raise ApiError(503, "the server is shutting down", kind="service_unavailable",
                               headers={"Retry-After": "5"})
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ApiError(400, f"the request body is not JSON: {error}") from None
            api = parse_request(body, chat, self.model, self.settings.default_max_tokens)
            handle = self._submit(api)
            steps = handle.asteps()
            watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
            try:
                first = await anext(steps)  # before any byte is sent: a bad request is still a 400
            except asyncio.CancelledError:
                watcher.cancel()
                raise
            except Exception as error:  # noqa: BLE001 - each as its status
                watcher.cancel()
                raise _api_error(error) from None
            if api.stream:
                return StreamingResponse(self._events(api, handle, first, steps, watcher),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                return JSONResponse(await self._whole(api, handle, first, steps))
            finally:
                watcher.cancel()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await serve(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await serve(request, chat=False)

        return app

    def _authorize(self, request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           kind="authentication_error", code="invalid_api_key")

    def _submit(self, api: ApiRequest) -> RequestHandle:
        pipeline = self.pipeline

        def prepare():
            return pipeline.request(api.prompt, api.max_new_tokens, api.stop, api.sampling or None,
                                    chat_template=None if api.chat else False, documents=api.documents)

        try:
            return pipeline.scheduler.submit(prepare)
        except Overloaded as error:
            status = 503 if self.draining or "shutting down" in str(error) else 429
            raise ApiError(status, str(error), kind="rate_limit_error" if status == 429 else "service_unavailable",
                           headers={"Retry-After": "1"}) from None

    async def _whole(self, api: ApiRequest, handle: RequestHandle, first, steps) -> dict:
        stats, tokens = GenerationStats(), []
        try:
            for step in [first] + [step async for step in steps]:
                stats.add(step)
                tokens.extend(step.tokens)
        except Exception as error:  # noqa: BLE001 - each as its status
            raise _api_error(error) from None
        trimmer = StopTrimmer(api.stop)
        trimmer.push(self.pipeline.decode_text(tokens))
        request = handle.request
        return response(api.chat, completion_id(api.chat), self.model, trimmer.answer,
                        finish_reason(request.stop.reason), len(request.prompt_ids), len(tokens),
                        speculation_stats(stats, request.retrieved), stats.reused_prompt_tokens)

    async def _events(self, api: ApiRequest, handle: RequestHandle, first, steps, watcher):
        """Server-sent events: a chunk per step's new text, the finish reason, the usage chunk where asked, [DONE]."""
        request_id, text, trimmer = completion_id(api.chat), IncrementalText(self.pipeline), StopTrimmer(api.stop)
        stats, count = GenerationStats(), 0

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            yield event(chunk(api.chat, request_id, self.model, "", first=True))
            step = first
            while step is not None:
                stats.add(step)
                count += len(step.tokens)
                piece = trimmer.push(text.push(step.tokens))
                if piece:
                    yield event(chunk(api.chat, request_id, self.model, piece))
                step = await anext(steps, None)
            tail = trimmer.push(text.flush()) + trimmer.finish()
            if tail:
                yield event(chunk(api.chat, request_id, self.model, tail))
            request = handle.request
            yield event(chunk(api.chat, request_id, self.model, None, finish_reason(request.stop.reason)))
            if api.include_usage:
                yield event(usage_chunk(api.chat, request_id, self.model, len(request.prompt_ids), count,
                                        speculation_stats(stats, request.retrieved), stats.reused_prompt_tokens))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            handle.cancel()  # the client went away: its place and cache go
            raise
        except Exception as error:  # noqa: BLE001 - headers are out: the error goes in the stream
            failure = _api_error(error)
            yield event(failure.body())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()

    # ---- running ---------------------------------------------------------------------------------------------
    def run(self, ready: threading.Event | None = None) -> int:
        """Serves until SIGTERM or Ctrl-C, the engine in this thread; returns the exit status."""
        import uvicorn

        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port, log_level="warning",
                                access_log=False, lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="specpipe-http", daemon=True)
        stop = threading.Event()

        def drain(signum=None, frame=None) -> None:
            if self.draining:
                return
            self.draining = True
            threading.Thread(target=self._shut_down, args=(server, stop), name="specpipe-shutdown").start()

        previous = [signal.signal(sig, drain) for sig in (signal.SIGTERM, signal.SIGINT)]
        scheduler = self.pipeline.scheduler
        scheduler.hold()  # the engine runs here: no request's reader may take it
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.02)
        if not thread.is_alive():
            scheduler.release()
            raise SpecpipeError(f"the server could not listen on {self.settings.host}:{self.settings.port}")
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"specpipe: serving pipeline={self.pipeline.name} model={self.model} on http://{host}:{port}/v1 "
              f"(engine={self.pipeline.target.engine}, {self.pipeline.target.dtype})", flush=True)
        if ready is not None:
            ready.set()
        try:
            scheduler.run(stop)
        finally:
            for sig, handler in zip((signal.SIGTERM, signal.SIGINT), previous):
                signal.signal(sig, handler)
        thread.join(timeout=10)
        return 0

    def _shut_down(self, server, stop: threading.Event) -> None:
        finished = self.pipeline.scheduler.shutdown(self.settings.grace_seconds)
        print(f"specpipe: shutting down: {'every request finished' if finished else 'requests past the grace period cancelled'}",
              file=sys.stderr, flush=True)
        server.should_exit = True
        stop.set()


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (the declared length at once, a streamed
    body as soon as it passes the limit)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, ApiError(413, f"the request body is over {self.limit} bytes"))
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _send_error(send, ApiError(413, f"the request body is over {self.limit} bytes"))


class _TooLarge(Exception):
    pass


async def _send_error(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _cancel_on_disconnect(request, handle: RequestHandle) -> None:
    """Cancels the request once its client has gone (a non-streamed request's answer would go nowhere)."""
    while not handle.done:
        if await request.is_disconnected():
            handle.cancel()
            return
        await asyncio.sleep(0.1)


def _api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidRequest):
        return ApiError(400, str(error))
    if isinstance(error, Cancelled):
        return ApiError(503, "the request was cancelled (the server is shutting down)", kind="service_unavailable")
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), kind="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(error, SpecpipeError):
        return ApiError(400, str(error))
    log.error("a request failed: %s: %s", type(error).__name__, error)
    return ApiError(500, f"the request failed: {type(error).__name__}", kind="server_error")
