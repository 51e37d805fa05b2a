"""A submitted request as its caller sees it: the steps it commits, from any thread or an asyncio task."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from specpipe.errors import SpecpipeError
from specpipe.pipelines.decoder import StepOutput
from specpipe.pipelines.stopping import StopCondition
from specpipe.types import SamplingConfig


class Cancelled(SpecpipeError):
    """The request was cancelled before it finished (by its caller, a closed stream or a shutdown)."""


@dataclass(frozen=True)
class DecodeRequest:
    """A checked request, ready to decode: its prompt's token ids and how to decode and stop."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop: StopCondition
    sampling: SamplingConfig
    document_ids: tuple[tuple[int, ...], ...] = ()
    retrieved: tuple = ()  # the RAG chunks the prompt was augmented with

    @property
    def tokens_reserved(self) -> int:
        """The KV rows this request may come to hold: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.max_new_tokens


class _Finished:
    """The last event of a request: done, or the exception that ended it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class RequestHandle:
    """What `submit` returns. The engine pushes the request's committed steps; the caller reads them with
    `steps()` (blocking: while nobody else drives the engine, the reading thread runs it), through the
    pipeline's `result`/`stream`, or with `asteps()` in asyncio, and may `cancel()` it at any time (a reader
    that stops early cancels it too). One reader per handle."""

    def __init__(self, request: DecodeRequest | None, prepare: Callable[[], DecodeRequest] | None = None,
                 scheduler=None) -> None:
        self.request = request  # None until the engine has called `prepare`
        self.prepare = prepare
        self._scheduler = scheduler  # the BatchScheduler it was submitted to: readers drive it
        self.submitted = time.perf_counter()
        self.first_token: float | None = None  # perf_counter() when the first step was pushed
        self.finished: float | None = None
        self.error: BaseException | None = None
        self._events: deque = deque()
        self._condition = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancelled = threading.Event()

    # ---- the scheduler's side ---------------------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def push(self, output: StepOutput) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self._put(output)

    def close(self, error: BaseException | None = None) -> None:
        """The request is over: finished (None), or failed or cancelled (`error`)."""
        self.finished = time.perf_counter()
        self.error = error
        self._put(_Finished(error))

    def poke(self) -> None:
        """Wakes a waiting reader without an event (the engine's driver role is free to take)."""
        self._put(None)

    def _put(self, event) -> None:
        with self._condition:
            if event is not None:
                self._events.append(event)
            self._condition.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ready in waiters:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the reader's loop has closed: nobody waits any more
                pass

    # ---- the caller's side ------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stops the request at the scheduler's next step and frees its cache; a reader then gets Cancelled."""
        self._cancelled.set()

    @property
    def done(self) -> bool:
        return self.finished is not None

    def steps(self, timeout: float | None = None) -> Iterator[StepOutput]:
        """The committed steps as they come (the prefill's first token first); raises the request's error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                event = self._next_event(deadline)
                if isinstance(event, _Finished):
                    if event.error is not None:
                        raise event.error
                    return
                yield event
        except GeneratorExit:
            self.cancel()  # a reader that stops early does not want the rest
            raise
        finally:
            if self._scheduler is not None:
                self._scheduler.release()  # where this thread drove the engine: another reader may

    def _next_event(self, deadline: float | None):
        while True:
            with self._condition:
                if self._events:
                    return self._events.popleft()
            if self._scheduler is not None and self._scheduler.drive(self):
                continue  # this thread ran an iteration of the engine: its events may be there now
            with self._condition:
                if self._events:
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the request did not finish in time")
                # short waits keep the reading thread responsive to KeyboardInterrupt
                self._condition.wait(0.25 if left is None else min(left, 0.25))

    async def asteps(self) -> AsyncIterator[StepOutput]:
        """`steps` for asyncio: awaits each step without blocking the event loop."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._condition:
                    event = self._events.popleft() if self._events else None
                    if event is None:
                        ready = asyncio.Event()
                        self._waiters.append((loop, ready))
                if event is None:
                    if self._scheduler is not None:
                        self._scheduler.ensure_driver()  # an event loop must not run the engine itself
                    await ready.wait()
                    continue
                if isinstance(event, _Finished):
                    if event.error is not None:
                        raise event.error
                    return
                yield event
        except (GeneratorExit, asyncio.CancelledError):
            self.cancel()
            raise
