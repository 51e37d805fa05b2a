"""A submitted request as its caller sees it: the steps it commits, from any thread or an asyncio task."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
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
    """What `submit` returns. The scheduler thread pushes the request's committed steps; the caller reads
    them with `steps()` (blocking), `stream()`/`result()` (through the pipeline), or `asteps()` in asyncio, and
    may `cancel()` it at any time (a stream closed early cancels it too). One reader per handle."""

    def __init__(self, request: DecodeRequest) -> None:
        self.request = request
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

    def _put(self, event) -> None:
        with self._condition:
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
                with self._condition:
                    while not self._events:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise TimeoutError("the request did not finish in time")
                        # short waits keep the reading thread responsive to KeyboardInterrupt
                        self._condition.wait(0.25 if left is None else min(left, 0.25))
                    event = self._events.popleft()
                if isinstance(event, _Finished):
                    if event.error is not None:
                        raise event.error
                    return
                yield event
        except GeneratorExit:
            self.cancel()  # a reader that stops early does not want the rest
            raise

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
