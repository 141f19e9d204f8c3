"""`strata serve-stdio`: JSON-lines requests on stdin, reply frames on stdout.

One engine answers requests one at a time. Across requests it keeps:

- a ring of committed-state checkpoints keyed by token prefix (serve/checkpoints.py): a prompt
  that starts with a checkpoint's tokens restores it and prefills only the rest;
- optionally, a cross-request suffix cache of earlier outputs for drafts
  (speculative/suffix_cache.py);
- optionally, a session file (serve/session.py) that carries the last request's state across runs.

While a request runs, the server looks at the lines that arrived behind it (serve/io.py
`ReadAhead`): a cancel line naming it stops it at the next prefill piece or window, and one
naming a request still waiting gets that request answered "cancelled" without running. Every
line is still answered once, in its turn.

Protocol: serve/protocol.py; I/O edges and signals: serve/io.py; docs: README.md, docs/serve.md.
Nothing here writes to stdout except through the `FrameWriter`; logs go to the "strata.serve"
logger, which the CLI sends to stderr.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..distributed import PipelineError
from ..engine.window import SnapshotError, WindowEngine
from ..options import GenerateOptions, ServeOptions, SpecOptions
from ..request import FINISH_CANCELLED, TextRequest
from ..runtime import Runtime
from ..speculative.drafters import request_drafter
from ..speculative.suffix_cache import GlobalSuffixCache
from ..telemetry import DecodeStats
from ..tokenizer import Tokenizer
from .chat import ChatTemplate, ChatTemplateError
from .checkpoints import Checkpoint, CheckpointRing, plan
from .io import EOF, NOTHING, LineReader, OversizeLine, ReadAhead, SignalFlag, protocol_stdout
from .protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LINE_TOO_LONG,
    MAX_CANCEL_LINE_BYTES,
    NO_CHAT_TEMPLATE,
    PROMPT_TOO_LONG,
    ClientGone,
    FrameWriter,
    Request,
    RequestError,
    cancel_frame,
    check_cancel,
    check_request,
    decode_line,
    delta_frame,
    error_frame,
    ready_frame,
)
from .session import SessionError, load_session, save_session

log = logging.getLogger("strata.serve")

POLL_SECONDS = 0.1  # how often an idle server looks at the signal latch
PROMPT_BYTES_SLACK = 2  # normalizers may shrink text a little before it is split into tokens
UNSTARTED_NOTE = "cancelled before it started"


@dataclass
class _Cancel:
    """A cancel line seen ahead of its turn: the id it names, its line number, and whether it
    stopped a request (what its answer says)."""

    target: Any
    number: int
    found: bool = False


class _Unstarted(Exception):
    """The request was cancelled before it generated anything: answer it without running it."""


def _id_key(request_id: Any) -> tuple[bool, Any] | None:
    """What ids are matched by (1 and "1" differ); None for null, which no cancel names."""
    return None if request_id is None else (isinstance(request_id, str), request_id)


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
        lines: the input lines not answered yet (`serve_lines` hands them to `handle`); looked
            at during each poll for cancel lines (default: none, so only `cancelled` stops).
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
        lines: ReadAhead | None = None,
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
        self.lines = lines
        self._number = 0  # the line number of the line being answered
        self._cancels: dict[tuple[bool, Any], list[_Cancel]] = {}  # seen ahead, not yet answered
        self._current: tuple[bool, Any] | None = None  # the id key of the request in flight
        self._is_stopped = False  # a cancel line named the request in flight
        self._was_cancelled = False  # a poll answered True during the request in flight

    def adopt(self, checkpoints: list[Checkpoint]) -> None:
        """Make restored checkpoints (a session, least recently used first) available for reuse."""
        for checkpoint in checkpoints:
            if self.ring is None or self.ring.add(checkpoint.tokens, checkpoint.snapshot) is None:
                log.warning("a session checkpoint of %d positions does not fit the prefix cache", checkpoint.length)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints held, least recently used first (what a session saves)."""
        return [] if self.ring is None else list(self.ring)

    # -- one line --------------------------------------------------------------------------------

    def handle(self, item: bytes | OversizeLine, *, number: int | None = None) -> None:
        """Answer one input line: a reply on stdout, whatever the line holds.

        Blank lines are skipped without a reply. A request is answered with its frames, a cancel
        line with one cancel frame, anything else with an error frame.

        Args:
            item: the line, as the line reader gives it.
            number: its line number (`ReadAhead`); default: the one after the last line handled.

        Raises:
            ClientGone: stdout is closed, so no reply can be delivered.
        """
        started = time.perf_counter()
        self._number = self._number + 1 if number is None else number
        request_id = None
        try:
            if isinstance(item, OversizeLine):
                raise RequestError(
                    LINE_TOO_LONG, f"the line has {item.num_bytes} bytes; the limit is {self.options.max_line_bytes}"
                )
            if not item.strip():
                return
            obj = decode_line(item)
            target = check_cancel(obj, len(item))
            if target is not None:
                self._answer_cancel(target)
                return
            request = check_request(obj, defaults=self.defaults, spec=self.spec)
            request_id = request.id
            self._start(request)
            try:
                if self._is_cancelled():
                    raise _Unstarted
                self._answer(request, started)
            except _Unstarted:
                log.debug("request %r: %s", request.id, UNSTARTED_NOTE)
                self.frames.send(self._unstarted_frame(request))
            finally:
                self._current = None
        except RequestError as e:
            log.debug("request %r: %s: %s", e.request_id, e.code, e.message)
            self.frames.send(error_frame(e.request_id, e.code, e.message))
        except (ClientGone, PipelineError):  # a rank went away: nothing more can be answered
            raise
        except Exception as e:  # the server outlives any one request; the engine starts clean
            log.exception("request %r failed", request_id)
            self.engine.reset()
            self.frames.send(error_frame(request_id, INTERNAL_ERROR, f"{type(e).__name__}: {e}"))

    # -- cancel lines ----------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        """Make `request` the one in flight; a cancel line already seen behind it stops it."""
        self._current = _id_key(request.id)
        self._is_stopped = self._was_cancelled = False
        for cancel in self._cancels.get(self._current, ()) if self._current is not None else ():
            if cancel.number > self._number:
                cancel.found = self._is_stopped = True

    def _is_cancelled(self) -> bool:
        """Polled between prefill pieces, decode steps and template lines: a signal (`cancelled`),
        or a cancel line naming the request in flight, looked for among the lines behind it."""
        if self.lines is not None and self._current is not None:
            for number, item in self.lines.look_ahead():
                self._see(number, item)
        stop = self._is_stopped or self.cancelled()
        self._was_cancelled |= stop
        return stop

    def _see(self, number: int, item: object) -> None:
        """Note a cancel line read ahead of its turn; every other line waits for its turn."""
        if not isinstance(item, bytes) or len(item) > MAX_CANCEL_LINE_BYTES or not item.strip():
            return
        try:
            target = check_cancel(decode_line(item), len(item))
        except RequestError:  # answered with its error in its turn
            return
        if target is None:
            return
        cancel = _Cancel(target, number)
        self._cancels.setdefault(_id_key(target), []).append(cancel)
        if _id_key(target) == self._current:
            cancel.found = self._is_stopped = True

    def _answer_cancel(self, target: Any) -> None:
        """A cancel line's turn: every request it stopped has been answered, so say whether there was one."""
        key = _id_key(target)
        seen = self._cancels.get(key, [])
        cancel = next((c for c in seen if c.number == self._number), None)
        if cancel is not None:
            seen.remove(cancel)
            if not seen:
                del self._cancels[key]
        found = cancel is not None and cancel.found
        log.debug("cancel %r: %s", target, "done" if found else "no such request in flight or waiting")
        self.frames.send(cancel_frame(target, found))

    def _unstarted_frame(self, request: Request) -> dict:
        stats = DecodeStats()
        stats.note(UNSTARTED_NOTE)
        return self._done_frame(request.id, text="", finish_reason=FINISH_CANCELLED, token_ids=[],
                                prompt_tokens=0, cached_tokens=0, stats=stats, ttft=None)

    # -- one request -----------------------------------------------------------------------------

    def _answer(self, request: Request, started: float) -> None:
        expert_cache = getattr(self.engine.model, "expert_cache", None)
        if expert_cache is not None:  # a failed prefetch of an earlier request is not this one's error
            expert_cache.begin_request()
        text = self._text_request(request)
        prompt_ids = text.prompt_ids
        reused, is_prefilled = self._prefill(prompt_ids, text.stats)
        if is_prefilled and not self._is_cancelled():
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
        self.frames.send(self._done_frame(request.id, text=text.text, finish_reason=text.finish_reason, token_ids=ids,
                                          prompt_tokens=len(prompt_ids), cached_tokens=reused, stats=stats, ttft=ttft))

    @staticmethod
    def _done_frame(request_id: Any, *, text: str, finish_reason: str, token_ids: list[int], prompt_tokens: int,
                    cached_tokens: int, stats: DecodeStats, ttft: float | None) -> dict:
        return {
            "id": request_id,
            "done": True,
            "text": text,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached_tokens,
                "completion_tokens": len(token_ids),
                "total_tokens": prompt_tokens + len(token_ids),
            },
            "stats": {**stats.summary(), "ttft_ms": None if ttft is None else 1000 * ttft, "notes": stats.notes},
        }

    def _decode(self, request: Request, text: TextRequest) -> None:
        """Generate from the prefilled engine until a finish, a stop string or a cancel,
        streaming delta frames when the request asks for them."""
        spec = self.spec_for(request.spec)
        drafter = request_drafter(text.prompt_ids, max_drafts=spec.max_drafts, min_match=spec.min_match,
                                  shared=[self.suffix_cache] if self.suffix_cache is not None else ())
        for delta in text.stream(self.engine, spec=spec, cancelled=self._is_cancelled, prefilled=self.engine.length,
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
                prompt = self.chat.render(request.messages, cancelled=self._is_cancelled)
            except ChatTemplateError as e:
                if self._was_cancelled:  # stopped by a signal or a cancel line, not by its own fault
                    raise _Unstarted from None
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
            if self._is_cancelled():
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


def serve_lines(server: Server, lines: ReadAhead, latch: SignalFlag, *, ready: dict | None = None) -> int:
    """Send the ready frame, then answer lines until EOF, a closed stdout, or a signal.

    Args:
        server: answers each line (and looks at `lines` for cancel lines while it runs one).
        lines: the input lines.
        latch: the signal flag.
        ready: the first frame (protocol.ready_frame), or None for none.

    Returns:
        0 at EOF (after the request in flight) or when stdout closes; 128 + the signal number
        after SIGINT or SIGTERM (the request in flight is answered with finish_reason "cancelled").
    """
    try:
        if ready is not None:
            server.frames.send(ready)
        while not latch.is_set():
            got = lines.get(POLL_SECONDS)
            if got is NOTHING:
                continue
            number, item = got
            if item is EOF:
                log.info("end of input")
                return 0
            server.handle(item, number=number)
    except ClientGone:
        log.info("stdout is closed; stopping")
        return 0
    log.info("signal %d: stopping", latch.signum)
    return 128 + latch.signum


def session_signature(runtime: Runtime) -> dict:
    """What a session file must match to be restored into `runtime`: the model's identity, the
    compute dtype and the whole model's state layout (across ranks too: one process's file)."""
    engine = runtime.engine
    if runtime.stage is not None:
        layout = engine.model.whole_layout(engine.options)
    else:
        layout = [type(state).__name__ for state in engine.states]
    return {"identity": runtime.identity, "dtype": str(runtime.dtype), "layout": layout}


def restore_session(runtime: Runtime, session: str | Path | None, *, command: str) -> list[Checkpoint]:
    """The checkpoints saved in `session` for `runtime`'s model, validated (signature, sizes,
    `engine.check_snapshot`), least recently used first: what `Server.adopt` takes. A file that
    does not exist yet is a new session (nothing to restore).

    Args:
        runtime: the opened checkpoint and its engine.
        session: the session file, or None (no session: nothing to restore).
        command: the command starting ('serve-stdio', 'strata serve'), named in the error.

    Raises:
        SessionError: its directory does not exist, or the file is corrupt, forged or another
            model's (one line; the command does not start).
    """
    if session is None:
        return []
    session, engine = Path(session), runtime.engine
    if not session.parent.is_dir():
        raise SessionError(f"session {session}: directory {session.parent} does not exist")
    if not session.exists():
        log.info("session %s: new", session)
        return []
    across_ranks = runtime.stage is not None
    try:
        restored = load_session(session, **session_signature(runtime), max_context=engine.max_context,
                                vocab_size=engine.vocab_size, check=None if across_ranks else engine.check_snapshot)
        if across_ranks:
            restored = place_across_ranks(engine, restored, session)
    except SessionError as e:
        raise SessionError(f"{e}; {command} did not start (delete the file or pass another --session)") from None
    log.info("session %s: restored %d checkpoints", session, len(restored))
    return restored


def place_across_ranks(engine, restored: list[Checkpoint], session: Path) -> list[Checkpoint]:
    """A session's checkpoints (every layer's state) as rank 0's engine holds them: the later
    ranks' layers' states sent to those ranks and checked there, rank 0's checked here.

    Raises:
        SessionError: a state some rank's layers cannot have made (the whole file is refused).
    """
    try:
        snapshots = engine.model.place([checkpoint.snapshot for checkpoint in restored])
    except SnapshotError as e:
        raise SessionError(f"session {session}: {e}") from None
    for c, snapshot in enumerate(snapshots):
        try:
            engine.check_snapshot(snapshot)
        except ValueError as e:
            raise SessionError(f"session {session}: checkpoint {c} ({snapshot.length} positions): {e}") from None
    return [Checkpoint(checkpoint.tokens, snapshot) for checkpoint, snapshot in zip(restored, snapshots)]


def save_session_of(runtime: Runtime, server: Server, session: str | Path | None) -> None:
    """Save `server`'s checkpoints to `session` (atomically, mode 0600) if one was taken since
    start; nothing when `session` is None or nothing changed.

    Raises:
        SessionError: the file cannot be written.
    """
    if session is None or not server.is_changed:
        return
    session, checkpoints = Path(session), server.checkpoints()
    if runtime.stage is not None:  # one process's file: the later ranks' layers' states gathered here
        snapshots = runtime.engine.model.gather([checkpoint.snapshot for checkpoint in checkpoints])
        checkpoints = [Checkpoint(c.tokens, snapshot) for c, snapshot in zip(checkpoints, snapshots)]
    try:
        save_session(session, checkpoints, **session_signature(runtime))
    except OSError as e:
        raise SessionError(f"session {session}: cannot write it ({e})") from None
    log.info("session %s: saved %d checkpoints (%d positions)", session, len(checkpoints),
             sum(c.length for c in checkpoints))


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
    restored = restore_session(runtime, serve_options.session, command="serve-stdio")

    latch = SignalFlag().install()
    try:
        with protocol_stdout() as stream:
            lines = ReadAhead(LineReader(0, serve_options.max_line_bytes).start())
            server = Server(
                engine, tokenizer, chat=chat, options=serve_options, defaults=defaults, spec=spec,
                frames=FrameWriter(stream), cancelled=latch.is_set, spec_for=runtime.spec_for, lines=lines,
            )
            server.adopt(restored)
            for note in runtime.load_notes:
                log.info("load: %s", note)
            log.info("ready: %s", runtime.path)
            ready = ready_frame(model=str(runtime.path), identity=runtime.identity,
                                dtype=str(runtime.dtype).removeprefix("mlx.core."), max_context=engine.max_context,
                                chat_template=chat is not None)
            status = serve_lines(server, lines, latch, ready=ready)
    finally:
        latch.uninstall()
    save_session_of(runtime, server, serve_options.session)
    return status
