"""`strata serve`: the OpenAI-compatible HTTP server (Starlette on uvicorn).

Two threads share the work:

- the event loop (uvicorn's, on a thread of its own) does I/O only: it reads a body (bounded),
  checks it (serve/openai_api.py, then serve-stdio's `check_request`, so a bad request is
  answered at once and never waits in the queue), queues a `Job`, and turns the frames that come
  back into a JSON body or server-sent events;
- the worker, on the thread that opened the model (MLX is not async, and its streams belong to
  the thread that made them: an array evaluated on another thread can abort the process at exit
  with MLX 0.32), takes jobs first in, first out and answers each through serve-stdio's
  `Server.handle` (serve/server.py), so prefix checkpoints, the cross-request suffix cache, chat
  templates, prompt checks and the engine reset after an internal error are serve-stdio's own,
  and so are the frames (docs/serve.md, "Replies").

A job's cancel flag is set when its client goes away (or its timeout passes); the `Server` polls
it between prefill pieces and decode windows, so the engine is free within one window. The
worker is the one place that takes requests to the engine: continuous batching would take several
jobs per window there, and nothing above it would change. Documented in docs/http.md.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import queue
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..options import (
    ConfigError,
    GenerateOptions,
    HttpOptions,
    ServeOptions,
    SpecOptions,
)
from ..runtime import Runtime
from .chat import ChatTemplate
from .metrics import CONTENT_TYPE, Metrics
from .openai_api import (
    CHAT,
    COMPLETIONS,
    TIMEOUT,
    ApiError,
    ApiRequest,
    Reply,
    to_request,
)
from .protocol import (
    INTERNAL_ERROR,
    FrameWriter,
    RequestError,
    check_request,
    decode_line,
    error_frame,
)
from .server import Server, restore_session, save_session_of

log = logging.getLogger("strata.serve")

END = object()  # a job's last item: the worker is done with it
RETRY_AFTER_SECONDS = 1
POLL_SECONDS = 0.1  # how often an idle worker looks whether the event loop has stopped
FIELD_IN_MESSAGE = re.compile(r"'?([a-z_]+)(?:'|\[| must)")  # check_request's messages start with their field


class Job:
    """One completion request on its way through the worker.

    Args:
        line: the serve-stdio request line the worker hands to `Server.handle`.
        stream: the client wants text deltas as they come (otherwise only the done frame).
        min_match: the request's suffix-match minimum, or None for the server's.
        deadline: `time.perf_counter()` after which it is stopped, or None.
    """

    def __init__(self, line: bytes, *, stream: bool, min_match: int | None, deadline: float | None):
        self.line, self.stream, self.min_match, self.deadline = line, stream, min_match, deadline
        self.loop = asyncio.get_running_loop()
        self.frames: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.started: float | None = None  # the worker took it
        self.last_delta: float | None = None
        self.done: dict | None = None  # the done frame, held until the worker lets the job go
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Stop it: at the next window when it runs, at once when it waits."""
        self._cancel.set()

    @property
    def is_cancelled(self) -> bool:
        return self._cancel.is_set() or (self.deadline is not None and time.perf_counter() > self.deadline)

    @property
    def is_client_gone(self) -> bool:
        return self._cancel.is_set()

    def put(self, item: object) -> None:
        """Hand a frame (or END) to the event loop (called on the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.frames.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _Frames(FrameWriter):
    """The `Server`'s frame writer: every frame goes to the worker, which routes it to its job."""

    def __init__(self, deliver: Callable[[dict], None]):
        self._deliver = deliver

    def send(self, frame: dict) -> None:
        self._deliver(frame)


class Worker:
    """Owns the engine and answers jobs one at a time, first in, first out, on the thread that
    calls `run` (the one that opened the model).

    Args:
        runtime: the opened model and its engine.
        chat: the checkpoint's chat template, or None.
        serve_options: prefix-cache and suffix-cache sizes (serve-stdio's).
        defaults: generate options for fields a request leaves out.
        spec: speculative options for fields a request leaves out.
        max_queue: jobs that may wait behind the one running.
    """

    def __init__(self, runtime: Runtime, *, chat: ChatTemplate | None, serve_options: ServeOptions,
                 defaults: GenerateOptions, spec: SpecOptions, max_queue: int):
        self.spec = spec
        self.jobs: queue.Queue = queue.Queue()  # bounded by `submit`, so a full queue is answered at once
        self.max_queue = max_queue
        self.current: Job | None = None
        self.is_draining = False  # a signal came: answer what is in, admit nothing new
        self.is_closing = False  # stop now: cancel the job running, drop the ones waiting
        self.metrics = Metrics(queued=self.jobs.qsize, running=lambda: int(self.current is not None))
        self.server = Server(runtime.engine, runtime.tokenizer, chat=chat, options=serve_options, defaults=defaults,
                             spec=spec, frames=_Frames(self._deliver), cancelled=self._is_cancelled,
                             spec_for=runtime.spec_for)
        self._lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Queue a job (on the event loop).

        Raises:
            ApiError: 503 with Retry-After when the queue is full or the server is stopping.
        """
        with self._lock:
            if self.is_draining or self.is_closing:
                raise ApiError(503, "the server is stopping", code="unavailable", kind="server_error")
            waiting = self.jobs.qsize() + (self.current is not None and self.max_queue == 0)
            if waiting >= max(self.max_queue, 1):
                raise ApiError(503, f"the server is busy: {self.max_queue} requests are already waiting; "
                               "retry later", code="queue_full", kind="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self.jobs.put_nowait(job)

    def run(self, *, until: Callable[[], bool]) -> None:
        """Answer jobs until `until()` is true with none waiting; then drop what is left (its
        clients are gone once the event loop has stopped)."""
        while True:
            try:
                job = self.jobs.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if until():
                    break
                continue
            self._take(job)
        self.is_closing = True
        while not self.jobs.empty():
            self.jobs.get_nowait().put(END)

    def _is_cancelled(self) -> bool:
        job = self.current
        return self.is_closing or (job is not None and job.is_cancelled)

    def _take(self, job: Job) -> None:
        if self.is_closing or job.is_client_gone:  # nobody would read the answer
            job.put(END)
        elif job.is_cancelled:
            job.put(error_frame(None, TIMEOUT, "the request timed out waiting in the queue"))
            job.put(END)
        else:
            self._answer(job)

    def _answer(self, job: Job) -> None:
        self.server.spec = self.spec if job.min_match is None else replace(self.spec, min_match=job.min_match)
        self.current, job.started = job, time.perf_counter()
        try:
            self.server.handle(job.line)
        except Exception as e:  # Server.handle answers every error itself; this is a last resort
            log.exception("the worker failed")
            if job.done is None:  # an answer already given stands
                job.put(error_frame(None, INTERNAL_ERROR, f"{type(e).__name__}: {e}"))
        finally:
            self.current = None  # before the done frame, so a client that has its answer sees the worker free
            self.server.spec = self.spec
            if job.done is not None:
                job.put(job.done)
            job.put(END)

    def _deliver(self, frame: dict) -> None:
        """A frame from the `Server`, on this thread: time it, count it, pass it on."""
        job, now = self.current, time.perf_counter()
        if job is None:  # assert-worthy, but a stray frame must not kill the worker
            log.warning("a frame with no request in flight: %r", frame)
            return
        if "delta" in frame:
            if job.last_delta is None:
                self.metrics.ttft.observe(now - job.arrived)
            else:
                self.metrics.window.observe(now - job.last_delta)
            job.last_delta = now
            if not job.stream:
                return
        elif frame.get("done"):
            ttft_ms = frame["stats"].get("ttft_ms")
            if job.last_delta is None and ttft_ms is not None:  # tokens came but no text did
                self.metrics.ttft.observe(job.started - job.arrived + ttft_ms / 1000)
            self.metrics.record_done(frame)
            self.metrics.request_seconds.observe(now - job.arrived)
            if job.is_client_gone:
                self.metrics.cancelled_by_client.inc()
            job.done = frame
            return
        job.put(frame)


class HttpApi:
    """The endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

    Args:
        worker: answers completions.
        options: what the server admits (body size, timeout, API key, the model's name).
        defaults: generate options (for checking requests as the worker will).
        fingerprint: the replies' `system_fingerprint`.
        max_context: positions a prompt and its output share (listed in /v1/models).
    """

    def __init__(self, worker: Worker, *, options: HttpOptions, defaults: GenerateOptions, fingerprint: str,
                 max_context: int):
        self.worker, self.options, self.defaults = worker, options, defaults
        self.fingerprint, self.max_context = fingerprint, max_context
        self.created = int(time.time())
        self._numbers = itertools.count(1)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})

    # -- endpoints ------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return self._guarded(request, lambda: {"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        def card():
            name = request.path_params["name"]
            if name != self.options.model_name:
                raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                               f"{self.options.model_name!r}", code="model_not_found", param="model")
            return self._model_card()

        return self._guarded(request, card)

    async def health(self, request: Request) -> Response:
        is_ok = not (self.worker.is_draining or self.worker.is_closing)
        body = {"status": "ok" if is_ok else "unavailable", "model": self.options.model_name, "version": __version__,
                "queued": self.worker.jobs.qsize(), "running": self.worker.current is not None}
        return self._count(request, JSONResponse(body, status_code=200 if is_ok else 503))

    async def metrics(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as e:
            return self._error(request, e)
        return self._count(request, Response(self.worker.metrics.render(), media_type=CONTENT_TYPE))

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, CHAT)

    # -- one completion -------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: str) -> Response:
        try:
            self._authorize(request)
            api = self._check(await self._body(request), kind)
            number = next(self._numbers)
            line = json.dumps({"id": number, **api.request, "stream": True}, ensure_ascii=True).encode()
            timeout = self.options.request_timeout
            job = Job(line, stream=api.stream, min_match=api.min_match,
                      deadline=None if timeout is None else time.perf_counter() + timeout)
            self.worker.submit(job)
        except ApiError as e:
            return self._error(request, e)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        is_streaming = False
        stopping = ApiError(503, "the server is stopping", code="unavailable", kind="server_error")
        try:
            first = await job.frames.get()
            if first is END:
                return self._error(request, stopping)
            if "error" in first:
                return self._error(request, ApiError.from_frame(first["error"]))
            reply = Reply(kind, model_name=self.options.model_name, fingerprint=self.fingerprint,
                          request_id=f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{number}-{self.created}")
            if api.stream:
                is_streaming = True
                events = self._events(job, first, reply, api, watcher)
                return self._count(request, StreamingResponse(events, media_type="text/event-stream",
                                                              headers={"Cache-Control": "no-cache",
                                                                       "X-Accel-Buffering": "no"}))
            frame = first
            while not frame.get("done"):
                if "error" in frame:
                    return self._error(request, ApiError.from_frame(frame["error"]))
                frame = await job.frames.get()
                if frame is END:  # the worker stopped at once (a second signal)
                    return self._error(request, stopping)
            return self._count(request, JSONResponse(reply.completion(frame)))
        finally:
            if not is_streaming:  # the events generator owns them from here
                job.cancel()
                watcher.cancel()

    async def _events(self, job: Job, frame: object, reply: Reply, api: ApiRequest,
                      watcher: asyncio.Task) -> AsyncIterator[bytes]:
        """The stream: a chunk per text delta, the finish chunk, the usage chunk, `[DONE]`."""
        first = True
        try:
            while frame is not END:
                if "delta" in frame:
                    yield _event(reply.chunk(frame["delta"], first=first, include_usage=api.include_usage))
                    first = False
                elif frame.get("done"):
                    if first and api.kind == CHAT:  # nothing was said: the role still comes first
                        yield _event(reply.chunk("", first=True, include_usage=api.include_usage))
                    yield _event(reply.chunk(None, finish_reason=frame["finish_reason"],
                                             include_usage=api.include_usage))
                    if api.include_usage:
                        yield _event(reply.usage_chunk(frame))
                    break
                elif "error" in frame:  # after the first delta: an internal error, the engine was reset
                    yield _event(ApiError.from_frame(frame["error"]).body())
                    break
                frame = await job.frames.get()
            yield b"data: [DONE]\n\n"
        finally:
            job.cancel()  # a client gone mid-stream frees the engine within a window
            watcher.cancel()

    def _check(self, body: bytes, kind: str) -> ApiRequest:
        """The body as a checked request, on the event loop: a bad one never waits in the queue."""
        try:
            api = to_request(decode_line(body), kind=kind, model_name=self.options.model_name)
            spec = self.worker.spec
            if api.min_match is not None:
                try:
                    spec = replace(spec, min_match=api.min_match)
                except ConfigError as e:
                    raise ApiError(400, str(e), code="out_of_range", param="min_match") from None
            check_request({"id": None, **api.request}, defaults=self.defaults, spec=spec)
        except RequestError as e:
            error = ApiError.from_frame({"code": e.code, "message": e.message})
            named = FIELD_IN_MESSAGE.match(e.message)
            error.param = named.group(1) if named else None
            raise error from None
        return api

    async def _body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    # -- answers --------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _guarded(self, request: Request, body: Callable[[], dict]) -> Response:
        try:
            self._authorize(request)
            return self._count(request, JSONResponse(body()))
        except ApiError as e:
            return self._error(request, e)

    def _model_card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "strata",
                "max_context": self.max_context}

    def _error(self, request: Request, error: ApiError) -> Response:
        log.debug("%s %s: %d %s: %s", request.method, request.url.path, error.status, error.code, error.message)
        return self._count(request, JSONResponse(error.body(), status_code=error.status, headers=error.headers))

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 and 405 in OpenAI's error shape."""
        return self._error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                             code="not_found" if exc.status_code == 404 else "invalid_request"))

    def _count(self, request: Request, response: Response) -> Response:
        route = request.scope.get("route")
        endpoint = route.path if route is not None else "other"
        self.worker.metrics.http_requests.labels(endpoint, str(response.status_code)).inc()
        return response


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more; the limit is {limit}",
                    code="request_too_large")


def _event(body: dict) -> bytes:
    """One server-sent event. A lone surrogate in generated text is escaped, as serve-stdio's
    frames escape it, rather than failing the stream."""
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(body, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    return b"data: " + text + b"\n\n"


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel `job` when its client goes away (the body is read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def model_name(model: str) -> str:
    """The served model's default id: 'demo', a hub repo id as given, a directory's own name."""
    path = Path(model)
    return path.name if path.is_dir() and model != "demo" else model


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one).

    Raises:
        OSError: the address cannot be resolved or bound (in use, not this machine's).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


@contextmanager
def _signals_drain(server: uvicorn.Server, worker: Worker):
    """The first SIGINT/SIGTERM drains (no new connections or requests; those in are answered);
    a second one stops at once (the request running ends at its next window, waiting ones are
    dropped). uvicorn runs off the main thread, so it leaves signals to us."""
    def on_signal(signum, frame):
        if worker.is_draining:
            server.force_exit = worker.is_closing = True
        server.should_exit = worker.is_draining = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_http(runtime: Runtime, *, http: HttpOptions, serve_options: ServeOptions, defaults: GenerateOptions,
               spec: SpecOptions, verbose: bool = False) -> int:
    """Restore the session (if any), serve the OpenAI HTTP API until SIGINT or SIGTERM, drain,
    save the session and return 0. The calling thread (the one that opened the model) runs the
    engine; uvicorn's event loop gets a thread.

    Args:
        runtime: the opened checkpoint (runtime.open_model) and its engine.
        http: address, queue, limits, API key and the model's name.
        serve_options: prefix-cache and suffix-cache sizes, and the session file (serve-stdio's).
        defaults: generate options for fields a request leaves out.
        spec: speculative options for fields a request leaves out.
        verbose: log every HTTP request (uvicorn's access log) and every strata request.

    Returns:
        0 once every request in flight or queued at the signal has been answered.

    Raises:
        OSError: the address cannot be bound.
        SessionError: the session file is corrupt, forged, another model's, or cannot be written.
        RuntimeError: the HTTP server stopped without being told to.
    """
    restored = restore_session(runtime, serve_options.session, command="strata serve")
    sock = listen(http.host, http.port)
    chat = ChatTemplate.from_model_dir(runtime.path)
    worker = Worker(runtime, chat=chat, serve_options=serve_options, defaults=defaults, spec=spec,
                    max_queue=http.max_queue)
    worker.server.adopt(restored)
    dtype = str(runtime.dtype).removeprefix("mlx.core.")
    api = HttpApi(worker, options=http, defaults=defaults, fingerprint=f"strata-{runtime.identity[:12]}-{dtype}",
                  max_context=runtime.engine.max_context)
    config = uvicorn.Config(api.app(), log_config=None, log_level="info" if verbose else "warning",
                            access_log=verbose, lifespan="off", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    loop = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="strata-http", daemon=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    try:
        with _signals_drain(server, worker):
            loop.start()
            log.info("listening on http://%s:%d/v1 (model %r, %s)", shown, port, http.model_name,
                     "chat template" if chat is not None else "no chat template")
            worker.run(until=lambda: not loop.is_alive())
    finally:
        sock.close()
    save_session_of(runtime, worker.server, serve_options.session)  # on the thread that owns the engine
    if not worker.is_draining:
        raise RuntimeError("the HTTP server stopped on its own (see the log above)")
    log.info("stopped")
    return 0
