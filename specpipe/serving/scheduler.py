"""Continuous batching: one thread owns the target and advances every running request by one step at a time,
all of them verified in one forward; requests join between steps and leave as soon as they end."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from specpipe.errors import ConfigError, InvalidRequest, SpecpipeError
from specpipe.pipelines.decoder import Sequence, SpeculativeDecoder, StepOutput
from specpipe.serving.handle import Cancelled, DecodeRequest, RequestHandle

log = logging.getLogger(__name__)


class Overloaded(SpecpipeError):
    """The engine's queue is full (or it is shutting down): retry later."""


@dataclass(frozen=True)
class SchedulerLimits:
    """How much the batch engine takes on. `max_sequences`: requests decoded at once (one batch);
    `max_queued`: requests waiting for a place, beyond which `submit` raises Overloaded; `max_tokens_in_flight`:
    the KV rows the running requests may come to hold (prompts plus their max_new_tokens), which bounds the
    caches' memory (a request larger than that alone is refused)."""

    max_sequences: int = 8
    max_queued: int = 64
    max_tokens_in_flight: int = 65536

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_queued", "max_tokens_in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"scheduler.{name} must be a positive integer, got {value!r}")


class SchedulerObserver:
    """What a scheduler tells whoever counts (the server's metrics): no-ops here."""

    def on_queue(self, queued: int, running: int) -> None: ...

    def on_step(self, handle: RequestHandle, output: StepOutput) -> None: ...

    def on_end(self, handle: RequestHandle, status: str) -> None:
        """status: 'finished', 'failed' or 'cancelled'."""


class BatchScheduler:
    """Owns a decoder; `submit` queues a checked request from any thread and returns its handle.

    Its thread admits queued requests while the limits allow (each prefilled in a forward of its own, its first
    token pushed at once), then runs one `SpeculativeDecoder.step` over every running request, pushes each its
    step, and drops those that finished, failed or were cancelled (their caches go with them). The thread
    starts with the first request and ends after `idle_seconds` without any."""

    def __init__(self, decoder: SpeculativeDecoder, limits: SchedulerLimits = SchedulerLimits(),
                 observer: SchedulerObserver | None = None, idle_seconds: float = 2.0) -> None:
        self.decoder = decoder
        self.limits = limits
        self.observer = observer or SchedulerObserver()
        self.idle_seconds = idle_seconds
        self._queue: deque[RequestHandle] = deque()
        self._running: list[tuple[Sequence, RequestHandle]] = []
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self.steps = 0  # batched steps run, for reports

    # ---- any thread ------------------------------------------------------------------------------------
    def submit(self, request: DecodeRequest) -> RequestHandle:
        if request.tokens_reserved > self.limits.max_tokens_in_flight:
            raise InvalidRequest(f"the request may hold {request.tokens_reserved} tokens (prompt + max_new_tokens), "
                                 f"more than this engine's scheduler.max_tokens_in_flight "
                                 f"({self.limits.max_tokens_in_flight}); shorten it")
        handle = RequestHandle(request)
        with self._condition:
            if not self._accepting:
                raise Overloaded("the engine is shutting down and takes no new requests")
            if len(self._queue) >= self.limits.max_queued:
                raise Overloaded(f"the engine's queue is full ({self.limits.max_queued} requests wait, "
                                 f"scheduler.max_queued); retry later")
            self._queue.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specpipe-scheduler", daemon=True)
                self._thread.start()
            self._condition.notify_all()
            self.observer.on_queue(len(self._queue), len(self._running))
        return handle

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def shutdown(self, grace_seconds: float = 30.0) -> bool:
        """Stops taking requests, lets those queued and running finish for up to `grace_seconds`, then cancels
        what is left. True when everything finished in time."""
        with self._condition:
            self._accepting = False
            self._condition.notify_all()
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline:
            with self._condition:
                if not self._queue and not self._running:
                    return True
            time.sleep(0.05)
        with self._condition:
            handles = list(self._queue) + [handle for _, handle in self._running]
        for handle in handles:
            handle.cancel()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (self._queue or self._running):
            time.sleep(0.05)
        return False

    # ---- the scheduler's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._running:
                    if not self._condition.wait(self.idle_seconds) and not self._queue:
                        self._thread = None  # a later submit starts a new thread
                        return
                admitted = self._admit()
            try:
                for handle in admitted:
                    self._start(handle)
                if self._running:
                    self._step()
            except BaseException as error:  # noqa: BLE001 - a bug here must not strand the callers
                log.exception("the batch scheduler failed; failing its running requests")
                for _, handle in self._running:
                    self._end(handle, error)
                self._running = []
                if not isinstance(error, Exception):
                    raise

    def _admit(self) -> list[RequestHandle]:
        """Requests to start now, first come first served (called holding the lock)."""
        admitted = []
        in_flight = sum(handle.request.tokens_reserved for _, handle in self._running)
        while self._queue and len(self._running) + len(admitted) < self.limits.max_sequences:
            handle = self._queue[0]
            if handle.cancelled:
                self._queue.popleft()
                self._end(handle, Cancelled("the request was cancelled before it started"))
                continue
            if in_flight + handle.request.tokens_reserved > self.limits.max_tokens_in_flight:
                break  # it waits for running requests to free their tokens
            self._queue.popleft()
            in_flight += handle.request.tokens_reserved
            admitted.append(handle)
        self.observer.on_queue(len(self._queue), len(self._running) + len(admitted))
        return admitted

    def _start(self, handle: RequestHandle) -> None:
        request = handle.request
        try:
            sequence, output = self.decoder.start(request.prompt_ids, request.stop, request.sampling,
                                                  request.document_ids)
        except Exception as error:  # noqa: BLE001 - this request's failure only
            self._end(handle, error)
            return
        self._deliver(handle, output)
        if sequence.finished:
            self._end(handle, None)
        else:
            with self._condition:
                self._running.append((sequence, handle))

    def _step(self) -> None:
        running = []
        for sequence, handle in self._running:
            if handle.cancelled:
                self._end(handle, Cancelled("the request was cancelled"))
            else:
                running.append((sequence, handle))
        self._running = running
        if not running:
            return
        outputs = self.decoder.step([sequence for sequence, _ in running])
        self.steps += 1
        still = []
        for (sequence, handle), output in zip(running, outputs):
            if isinstance(output, BaseException):
                self._end(handle, output)
                continue
            self._deliver(handle, output)
            if output.finished:
                self._end(handle, None)
            else:
                still.append((sequence, handle))
        with self._condition:
            self._running = still

    def _deliver(self, handle: RequestHandle, output: StepOutput) -> None:
        handle.push(output)
        self.observer.on_step(handle, output)

    def _end(self, handle: RequestHandle, error: BaseException | None) -> None:
        handle.close(error)
        status = "finished" if error is None else "cancelled" if isinstance(error, Cancelled) else "failed"
        self.observer.on_end(handle, status)

