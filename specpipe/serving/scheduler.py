"""Continuous batching: the engine advances every running request by one step at a time, all of them verified in
one forward; requests join between steps and leave as soon as they end.

Who runs the engine. One thread at a time holds the driver's role and runs the engine's iterations (admit, then
one step of the batch); every torch op of the engine runs there. A thread reading its request's steps takes the
role where nobody holds it and keeps it until its own request ends (`Pipeline.generate` from the main thread
drives the engine itself); `run` gives the role to one thread until told to stop (the server and the load
benchmark run it in the main thread); asyncio readers with nobody driving start a background thread that drives
while there is work. Why not always a thread of the engine's own: OpenMP shortens its workers' spinning to
almost nothing once more threads have OpenMP teams than the process has CPUs, and the main thread keeps the team
it made while the model loaded; a forward of the embedded model then took 27 ms in a second thread against 15.5
ms in the main thread (bf16, 2 CPUs). So torch runs in as few threads as possible, the main thread first.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specpipe.errors import ConfigError, InvalidRequest, SpecpipeError
from specpipe.pipelines.decoder import Sequence, SpeculativeDecoder, Starting, StepOutput
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
    """Owns a decoder; `submit` queues a request from any thread and returns its handle.

    An iteration of the engine admits queued requests while the limits allow, runs the next forward of the
    oldest request being prefilled (its whole prompt, or with a prefix cache a chunk of it, so that a long prompt
    does not stop the others' decoding; its first token pushed after the last), then runs one
    `SpeculativeDecoder.step` over every running request, pushes each its step, and drops those that finished,
    failed or were cancelled (their caches go with them). See the module's doc for which thread runs the
    iterations."""

    def __init__(self, decoder: SpeculativeDecoder, limits: SchedulerLimits = SchedulerLimits(),
                 observer: SchedulerObserver | None = None, idle_seconds: float = 2.0) -> None:
        self.decoder = decoder
        self.limits = limits
        self.observer = observer or SchedulerObserver()
        self.idle_seconds = idle_seconds  # how long a background driver waits for work before it ends
        self._queue: deque[RequestHandle] = deque()
        self._prefilling: list[tuple[Starting, RequestHandle]] = []  # admitted, first come first prefilled
        self._running: list[tuple[Sequence, RequestHandle]] = []
        self._condition = threading.Condition()
        self._driver: threading.Thread | None = None  # the thread that holds the role
        self._held = False  # `run` holds the role until stopped
        self._accepting = True
        self.steps = 0  # batched steps run, for reports

    # ---- any thread ------------------------------------------------------------------------------------
    def submit(self, request: DecodeRequest | Callable[[], DecodeRequest]) -> RequestHandle:
        """Queues a checked request, or a function that makes one: it is called by the engine's thread when the
        request's turn comes (retrieval runs torch, which belongs in that thread), and what it raises fails the
        request."""
        if isinstance(request, DecodeRequest):
            self._check_size(request)
            handle = RequestHandle(request, scheduler=self)
        else:
            handle = RequestHandle(None, prepare=request, scheduler=self)
        with self._condition:
            if not self._accepting:
                raise Overloaded("the engine is shutting down and takes no new requests")
            if len(self._queue) >= self.limits.max_queued:
                raise Overloaded(f"the engine's queue is full ({self.limits.max_queued} requests wait, "
                                 f"scheduler.max_queued); retry later")
            self._queue.append(handle)
            self._condition.notify_all()
            self.observer.on_queue(len(self._queue), self.running)
        return handle

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests holding a place: being prefilled or decoded."""
        return len(self._prefilling) + len(self._running)

    def shutdown(self, grace_seconds: float = 30.0) -> bool:
        """Stops taking requests, lets those queued and running finish for up to `grace_seconds`, then cancels
        what is left. True when everything finished in time."""
        with self._condition:
            self._accepting = False
            self._condition.notify_all()
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and self._has_work():
            self.ensure_driver()
            time.sleep(0.02)
        if not self._has_work():
            return True
        with self._condition:
            handles = list(self._queue) + self._placed()
        for handle in handles:
            handle.cancel()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and self._has_work():
            self.ensure_driver()  # someone must drop the cancelled requests
            time.sleep(0.02)
        return False

    # ---- driving ----------------------------------------------------------------------------------------
    def drive(self, reader: RequestHandle) -> bool:
        """For a thread waiting for `reader`'s next step: runs one iteration of the engine in this thread where no
        other thread drives, keeping the role until `reader` ends; False where another thread drives."""
        me = threading.current_thread()
        with self._condition:
            if self._driver is None and not reader.done:
                self._driver = me
            if self._driver is not me:
                return False
        try:
            self._iterate()
        except BaseException:
            self.release()
            raise
        if reader.done or not self._has_work():
            self.release()
        return True

    def release(self) -> None:
        """The calling thread gives up the driver's role (a reader whose request ended, or that stopped reading)."""
        with self._condition:
            if self._driver is threading.current_thread() and not self._held:
                self._driver = None
                waiting = list(self._queue) + self._placed()
            else:
                waiting = []
        for handle in waiting:  # another reader may take the role
            handle.poke()

    def hold(self) -> None:
        """Makes the calling thread the engine's driver (once the thread that drives now lets go), for `run`:
        taken before the threads that submit and read start, they never drive."""
        me = threading.current_thread()
        with self._condition:
            while self._driver not in (None, me):
                self._condition.wait(0.05)
            self._driver, self._held = me, True

    def run(self, stop: threading.Event) -> None:
        """Runs the engine in the calling thread until `stop` is set, waiting for work when there is none; then
        gives the driver's role up."""
        self.hold()
        try:
            while not stop.is_set():
                if self._has_work():
                    self._iterate()
                else:
                    with self._condition:
                        self._condition.wait(0.05)
        finally:
            with self._condition:
                self._held = False
            self.release()

    def ensure_driver(self) -> None:
        """Starts a background thread to drive where no thread does and there is work (for asyncio readers)."""
        with self._condition:
            if self._driver is not None or not self._has_work():
                return
            thread = threading.Thread(target=self._drive_in_background, name="specpipe-engine", daemon=True)
            self._driver = thread
        thread.start()

    def _drive_in_background(self) -> None:
        idle_since = time.monotonic()
        try:
            while True:
                if self._has_work():
                    self._iterate()
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self.idle_seconds:
                    return
                else:
                    with self._condition:
                        self._condition.wait(0.05)
        except BaseException:  # noqa: BLE001 - logged; the readers get their errors from _iterate
            log.exception("the batch engine's background driver failed")
        finally:
            with self._condition:
                self._driver = None
                waiting = list(self._queue) + self._placed()
            for handle in waiting:
                handle.poke()

    def _has_work(self) -> bool:
        return bool(self._queue or self._prefilling or self._running)

    def _placed(self) -> list[RequestHandle]:
        """The requests holding a place (being prefilled or decoded)."""
        return [handle for _, handle in self._prefilling] + [handle for _, handle in self._running]

    # ---- one iteration (the driver's thread) -------------------------------------------------------------
    def _iterate(self) -> None:
        try:
            for handle in self._admit():
                self._begin(handle)
            if self._prefilling:
                self._advance_prefill()
            if self._running:
                self._step()
        except Exception as error:  # noqa: BLE001 - a bug here must not strand the readers
            log.exception("the batch engine failed; failing its running requests")
            for handle in self._placed():
                self._end(handle, error)
            with self._condition:
                self._prefilling, self._running = [], []

    def _admit(self) -> list[RequestHandle]:
        """Requests to start now, first come first served; a queued function is made into its request here."""
        admitted: list[RequestHandle] = []
        in_flight = sum(handle.request.tokens_reserved for handle in self._placed())
        while True:
            with self._condition:
                if not self._queue or self.running + len(admitted) >= self.limits.max_sequences:
                    break
                handle = self._queue[0]
                if handle.cancelled:
                    self._queue.popleft()
                    self._end(handle, Cancelled("the request was cancelled before it started"))
                    continue
                if handle.request is not None:
                    if in_flight + handle.request.tokens_reserved > self.limits.max_tokens_in_flight:
                        break  # it waits for running requests to free their tokens
                    self._queue.popleft()
                    in_flight += handle.request.tokens_reserved
                    admitted.append(handle)
                    continue
            try:  # outside the lock: preparing a request may take a while (retrieval)
                handle.request = handle.prepare()
                self._check_size(handle.request)
            except Exception as error:  # noqa: BLE001 - this request's failure only
                with self._condition:
                    self._queue.remove(handle)
                self._end(handle, error)
        with self._condition:
            self.observer.on_queue(len(self._queue), self.running + len(admitted))
        return admitted

    def _check_size(self, request: DecodeRequest) -> None:
        if request.tokens_reserved > self.limits.max_tokens_in_flight:
            raise InvalidRequest(f"the request may hold {request.tokens_reserved} tokens (prompt + max_new_tokens), "
                                 f"more than this engine's scheduler.max_tokens_in_flight "
                                 f"({self.limits.max_tokens_in_flight}); shorten it")

    def _begin(self, handle: RequestHandle) -> None:
        request = handle.request
        try:
            starting = self.decoder.begin(request.prompt_ids, request.stop, request.sampling, request.document_ids)
        except Exception as error:  # noqa: BLE001 - this request's failure only
            self._end(handle, error)
            return
        with self._condition:
            self._prefilling.append((starting, handle))

    def _advance_prefill(self) -> None:
        """The next forward of the oldest request being prefilled (the cancelled ones dropped first); once it has
        started, its first token is pushed and it joins the running requests."""
        cancelled = [handle for _, handle in self._prefilling if handle.cancelled]
        with self._condition:
            self._prefilling = [item for item in self._prefilling if not item[1].cancelled]
        for handle in cancelled:
            self._end(handle, Cancelled("the request was cancelled"))
        if not self._prefilling:
            return
        starting, handle = self._prefilling[0]
        try:
            if not self.decoder.advance(starting):
                return
        except Exception as error:  # noqa: BLE001 - this request's failure only
            with self._condition:
                self._prefilling.pop(0)
            self._end(handle, error)
            return
        with self._condition:
            self._prefilling.pop(0)
        sequence = starting.sequence
        self._deliver(handle, starting.output)
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
        with self._condition:
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
