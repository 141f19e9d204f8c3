"""`strata serve-stdio`: JSON-lines requests on stdin, reply frames on stdout.

One engine answers requests one at a time. Across requests it keeps:

- a ring of committed-state checkpoints keyed by token prefix (serve/checkpoints.py): a prompt
  that starts with a checkpoint's tokens restores it and prefills only the rest;
- optionally, a cross-request suffix cache of earlier outputs for drafts
  (speculative/suffix_cache.py);
- optionally, a session file (serve/session.py) that carries the last request's state across runs.

Protocol: serve/protocol.py; I/O edges and signals: serve/io.py; docs: README.md, docs/serve.md.
Nothing here writes to stdout except through the `FrameWriter`; logs go to the "strata.serve"
logger, which the CLI sends to stderr.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..engine.window import WindowEngine
from ..options import GenerateOptions, ServeOptions, SpecOptions
from ..request import TextRequest
from ..runtime import Runtime
from ..speculative.drafters import request_drafter
from ..speculative.suffix_cache import GlobalSuffixCache
from ..telemetry import DecodeStats
from ..tokenizer import Tokenizer
from .chat import ChatTemplate, ChatTemplateError
from .checkpoints import Checkpoint, CheckpointRing, plan
from .io import EOF, NOTHING, LineReader, OversizeLine, SignalFlag, protocol_stdout
from .protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LINE_TOO_LONG,
    NO_CHAT_TEMPLATE,
    PROMPT_TOO_LONG,
    ClientGone,
    FrameWriter,
    Request,
    RequestError,
    check_request,
    decode_line,
    delta_frame,
    error_frame,
)
from .session import SessionError, load_session, save_session

log = logging.getLogger("strata.serve")

POLL_SECONDS = 0.1  # how often an idle server looks at the signal latch
PROMPT_BYTES_SLACK = 2  # normalizers may shrink text a little before it is split into tokens


class Server:
    """Answers checked requests on one engine, reusing committed state across them.

    Args:
        engine: the window engine (its state belongs to the server between requests).
        tokenizer: the checkpoint's tokenizer.
        chat: the checkpoint's chat template, or None (then `messages` gets an error reply).
        options: prefix-cache, suffix-cache and line limits.
        defaults: generate options for fields a request leaves out.
        spec: speculative options for fields a request leaves out (`min_match` is server-wide).
        frames: where reply frames go.
        cancelled: polled between prefill pieces and decode steps; True aborts the request in
            flight with a "cancelled" reply (default: never).
        spec_for: completes each request's speculative options (`Runtime.spec_for`: an `auto`
            request gets the device's measured cost curve even when the server's default is not
            auto); default: as given.
    """

    def __init__(
        self,
        engine: WindowEngine,
        tokenizer: Tokenizer,
        *,
        chat: ChatTemplate | None,
        options: ServeOptions,
        defaults: GenerateOptions,
        spec: SpecOptions,
        frames: FrameWriter,
        cancelled: Callable[[], bool] = lambda: False,
        spec_for: Callable[[SpecOptions], SpecOptions] = lambda spec: spec,
    ):
        self.engine = engine
        self.spec_for = spec_for
        self.tokenizer = tokenizer
        self.chat = chat
        self.options = options
        self.defaults = defaults
        self.spec = spec
        self.frames = frames
        self.cancelled = cancelled
        self.ring = (
            CheckpointRing(options.prefix_cache_entries, options.prefix_cache_positions)
            if options.prefix_cache_entries
            else None
        )
        self.suffix_cache = (
            GlobalSuffixCache(options.suffix_cache_tokens, min_match=spec.min_match)
            if options.suffix_cache_tokens
            else None
        )
        self.is_changed = False  # a checkpoint was taken since start (the session needs saving)

    def adopt(self, checkpoints: list[Checkpoint]) -> None:
        """Make restored checkpoints (a session, least recently used first) available for reuse."""
        for checkpoint in checkpoints:
            if self.ring is None or self.ring.add(checkpoint.tokens, checkpoint.snapshot) is None:
                log.warning("a session checkpoint of %d positions does not fit the prefix cache", checkpoint.length)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints held, least recently used first (what a session saves)."""
        return [] if self.ring is None else list(self.ring)

    # -- one line --------------------------------------------------------------------------------

    def handle(self, item: bytes | OversizeLine) -> None:
        """Answer one input line: a reply on stdout, whatever the line holds.

        Blank lines are skipped without a reply.

        Raises:
            ClientGone: stdout is closed, so no reply can be delivered.
        """
        started = time.perf_counter()
        request_id = None
        try:
            if isinstance(item, OversizeLine):
                raise RequestError(
                    LINE_TOO_LONG, f"the line has {item.num_bytes} bytes; the limit is {self.options.max_line_bytes}"
                )
            if not item.strip():
                return
            obj = decode_line(item)
            request = check_request(obj, defaults=self.defaults, spec=self.spec)
            request_id = request.id
            self._answer(request, started)
        except RequestError as e:
            log.debug("request %r: %s: %s", e.request_id, e.code, e.message)
            self.frames.send(error_frame(e.request_id, e.code, e.message))
        except ClientGone:
            raise
        except Exception as e:  # the server outlives any one request; the engine starts clean
            log.exception("request %r failed", request_id)
            self.engine.reset()
            self.frames.send(error_frame(request_id, INTERNAL_ERROR, f"{type(e).__name__}: {e}"))

    # -- one request -----------------------------------------------------------------------------

    def _answer(self, request: Request, started: float) -> None:
        expert_cache = getattr(self.engine.model, "expert_cache", None)
        if expert_cache is not None:  # a failed prefetch of an earlier request is not this one's error
            expert_cache.begin_request()
        text = self._text_request(request)
        prompt_ids = text.prompt_ids
        reused, is_prefilled = self._prefill(prompt_ids, text.stats)
        if is_prefilled and not self.cancelled():
            self._decode(request, text)
        last = text.close()
        if last and request.stream:
            self.frames.send(delta_frame(request.id, last))
        ids, stats = text.token_ids, text.stats
        ttft = None if text.first_token_at is None else text.first_token_at - started
        for note in stats.notes:
            log.info("request %r: %s", request.id, note)
        log.debug("request %r: %d prompt tokens (%d reused), %d generated, %s", request.id,
                  len(prompt_ids), reused, len(ids), text.finish_reason)
        self.frames.send({
            "id": request.id,
            "done": True,
            "text": text.text,
            "finish_reason": text.finish_reason,
            "token_ids": ids,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "cached_tokens": reused,
                "completion_tokens": len(ids),
                "total_tokens": len(prompt_ids) + len(ids),
            },
            "stats": {**stats.summary(), "ttft_ms": None if ttft is None else 1000 * ttft, "notes": stats.notes},
        })

    def _decode(self, request: Request, text: TextRequest) -> None:
        """Generate from the prefilled engine until a finish, a stop string or a cancel,
        streaming delta frames when the request asks for them."""
        spec = self.spec_for(request.spec)
        drafter = request_drafter(text.prompt_ids, max_drafts=spec.max_drafts, min_match=spec.min_match,
                                  shared=[self.suffix_cache] if self.suffix_cache is not None else ())
        for delta in text.stream(self.engine, spec=spec, cancelled=self.cancelled, prefilled=self.engine.length,
                                 drafter=drafter):
            if request.stream:
                self.frames.send(delta_frame(request.id, delta))
        # Committed: the prompt and the outputs, less the final root (not yet processed).
        self._checkpoint((text.prompt_ids + text.token_ids)[: self.engine.length])
        if self.suffix_cache is not None:
            self.suffix_cache.add(text.token_ids)

    def _text_request(self, request: Request) -> TextRequest:
        """The request as text (a chat template rendered), tokenized, checked against the
        context. A chat-rendered prompt ends where its template says, so it is not healed."""
        if request.messages is not None:
            if self.chat is None:
                raise RequestError(
                    NO_CHAT_TEMPLATE,
                    "this model has no chat template (tokenizer_config.json has no chat_template); send 'prompt'",
                    request.id,
                )
            try:
                prompt = self.chat.render(request.messages, cancelled=self.cancelled)
            except ChatTemplateError as e:
                raise RequestError(e.code, str(e), request.id) from None
        else:
            prompt = request.prompt
        # Tokenizing costs far more memory than the text: one this long cannot fit the context.
        num_bytes = len(prompt.encode("utf-8", "surrogatepass"))
        if num_bytes > PROMPT_BYTES_SLACK * self.engine.max_context * self.tokenizer.max_token_bytes:
            raise RequestError(
                PROMPT_TOO_LONG,
                f"the prompt has {num_bytes} bytes, far more than the context of {self.engine.max_context} "
                "tokens holds",
                request.id,
            )
        text = TextRequest(self.tokenizer, prompt, request.options, stop=request.stop,
                           heal=request.messages is None)
        if not text.ids:
            raise RequestError(INVALID_REQUEST, "the prompt encodes to no tokens", request.id)
        if len(text.ids) > self.engine.max_context:
            raise RequestError(
                PROMPT_TOO_LONG,
                f"the prompt has {len(text.ids)} tokens but the context holds {self.engine.max_context}",
                request.id,
            )
        return text

    def _prefill(self, prompt_ids: list[int], stats: DecodeStats) -> tuple[int, bool]:
        """Bring the engine to the prompt minus its root, from the longest usable checkpoint.

        Returns:
            (positions restored from a checkpoint, whether the prefill completed: False when
            cancelled part-way, at a checkpointed position).
        """
        end = len(prompt_ids) - 1
        self.engine.reset()
        reused, points = 0, [end] if end > 0 else []
        if self.ring is not None:
            hit = self.ring.longest_prefix(prompt_ids, max_length=end)
            if hit is not None:
                self.engine.restore(hit.snapshot)
                reused = hit.length
            divergence = self.ring.longest_common_prefix(prompt_ids)
            points = plan(reused, end, every=self.options.checkpoint_every, divergence=divergence)
        start = time.perf_counter()
        for point in points:
            if self.cancelled():
                break
            self.engine.prefill(prompt_ids[self.engine.length : point])
            self._checkpoint(prompt_ids[:point])
        stats.record_prefill(self.engine.length - reused, time.perf_counter() - start)
        return reused, self.engine.length == end

    def _checkpoint(self, tokens: list[int]) -> None:
        """Keep the engine's committed state (after exactly `tokens`) for reuse."""
        if self.ring is None:
            return
        mx.eval(self.engine.state_tensors())  # run pending lazy folds now, not inside a later graph
        self.ring.add(tokens, self.engine.snapshot())
        self.is_changed = True


def serve_lines(server: Server, reader: LineReader, latch: SignalFlag) -> int:
    """Answer lines until EOF, a closed stdout, or a signal.

    Returns:
        0 at EOF (after the request in flight) or when stdout closes; 128 + the signal number
        after SIGINT or SIGTERM (the request in flight is answered with finish_reason "cancelled").
    """
    while not latch.is_set():
        item = reader.get(POLL_SECONDS)
        if item is NOTHING:
            continue
        if item is EOF:
            log.info("end of input")
            return 0
        try:
            server.handle(item)
        except ClientGone:
            log.info("stdout is closed; stopping")
            return 0
    log.info("signal %d: stopping", latch.signum)
    return 128 + latch.signum


def serve_stdio(
    runtime: Runtime,
    *,
    serve_options: ServeOptions,
    defaults: GenerateOptions,
    spec: SpecOptions,
) -> int:
    """Restore the session, serve stdin until EOF or a signal, save the session.

    Args:
        runtime: the opened checkpoint (runtime.open_model) and its engine.
        serve_options: caches, session file and line limit.
        defaults: generate options for fields a request leaves out.
        spec: speculative options for fields a request leaves out.

    Returns:
        The exit status (see `serve_lines`).

    Raises:
        SessionError: the session file is corrupt, another model's, or cannot be written.
    """
    engine, tokenizer = runtime.engine, runtime.tokenizer
    chat = ChatTemplate.from_model_dir(runtime.path)
    session = Path(serve_options.session) if serve_options.session else None
    signature = {
        "identity": runtime.identity,
        "dtype": str(runtime.dtype),
        "layout": [type(state).__name__ for state in engine.states],
    }
    restored = None
    if session is not None:
        if not session.parent.is_dir():
            raise SessionError(f"session {session}: directory {session.parent} does not exist")
        if session.exists():
            try:
                restored = load_session(session, **signature, max_context=engine.max_context,
                                        vocab_size=engine.vocab_size)
            except SessionError as e:
                raise SessionError(f"{e}; serve-stdio did not start (delete the file or pass another --session)") from None
            log.info("session %s: restored %d checkpoints", session, len(restored))
        else:
            log.info("session %s: new", session)

    latch = SignalFlag().install()
    try:
        with protocol_stdout() as stream:
            server = Server(
                engine, tokenizer, chat=chat, options=serve_options, defaults=defaults, spec=spec,
                frames=FrameWriter(stream), cancelled=latch.is_set, spec_for=runtime.spec_for,
            )
            server.adopt(restored or [])
            log.info("ready: %s", runtime.path)
            status = serve_lines(server, LineReader(0, serve_options.max_line_bytes).start(), latch)
    finally:
        latch.uninstall()
    if session is not None and server.is_changed:
        checkpoints = server.checkpoints()
        try:
            save_session(session, checkpoints, **signature)
        except OSError as e:
            raise SessionError(f"session {session}: cannot write it ({e})") from None
        log.info("session %s: saved %d checkpoints (%d positions)", session, len(checkpoints),
                 sum(c.length for c in checkpoints))
    return status
