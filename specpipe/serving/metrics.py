"""What the server counts, in Prometheus' text format (`GET /metrics`): requests by status, tokens in and out,
latencies, the queue, and speculation with vLLM's counters and their meanings."""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specpipe.pipelines.decoder import StepOutput
from specpipe.serving.handle import RequestHandle
from specpipe.serving.scheduler import SchedulerObserver

PREFIX = "specpipe:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics(SchedulerObserver):
    """The scheduler's observer: counts every request's steps as they are pushed (the engine's thread) and what the
    HTTP layer refused (the server's). Its own registry, so that several servers in one process do not mix.

    Speculation, as vLLM counts it: `spec_decode_num_drafts` steps that verified a draft, `..._num_draft_tokens`
    the draft tokens verified, `..._num_accepted_tokens` those accepted, `..._num_accepted_tokens_per_pos` accepted
    tokens by their position in the draft (position 0 is the first token after the committed text)."""

    def __init__(self, prefix_caching: bool = False) -> None:
        self.prefix_caching = prefix_caching  # whether prompts go through a prefix cache (prefix_cache.*)
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Requests by how they ended", ["status"], registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of started requests", registry=registry)
        # vLLM's prefix cache counters, in tokens: looked up, and found (hits / queries is the hit rate)
        self.prefix_cache_queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache", registry=registry)
        self.prefix_cache_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens whose rows the prefix cache "
                                         "gave", registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(f"{PREFIX}time_to_first_token_seconds", "From submission to the first "
                                             "token", buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between a request's steps, per "
                                             "token they committed", buckets=LATENCY_BUCKETS, registry=registry)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests queued for a place", registry=registry)
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests being prefilled or decoded",
                             registry=registry)
        self.drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Steps that verified a draft", registry=registry)
        self.draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified", registry=registry)
        self.accepted_tokens = Counter(f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=registry)
        self.accepted_per_position = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted, by their position in the draft", ["position"],
                                             registry=registry)
        self._last_step: dict[int, float] = {}  # id(handle) -> when its last step was pushed
        self._lock = threading.Lock()

    def on_queue(self, queued: int, running: int) -> None:
        self.waiting.set(queued)
        self.running.set(running)

    def on_step(self, handle: RequestHandle, output: StepOutput) -> None:
        now = time.perf_counter()
        with self._lock:
            last = self._last_step.get(id(handle))
            self._last_step[id(handle)] = now
        if last is None:  # the prefill's token
            self.prompt_tokens.inc(len(handle.request.prompt_ids))
            if self.prefix_caching:
                self.prefix_cache_queries.inc(len(handle.request.prompt_ids))
                self.prefix_cache_hits.inc(output.reused_prompt_tokens)
            self.time_to_first_token.observe(now - handle.submitted)
        elif output.tokens:
            gap = (now - last) / len(output.tokens)
            for _ in output.tokens:
                self.inter_token_latency.observe(gap)
        self.generation_tokens.inc(len(output.tokens))
        if output.stats.tree_size:
            self.drafts.inc()
            self.draft_tokens.inc(output.stats.tree_size)
            self.accepted_tokens.inc(output.drafted)
            for position in range(output.drafted):
                self.accepted_per_position.labels(position=str(position)).inc()

    def on_end(self, handle: RequestHandle, status: str) -> None:
        with self._lock:
            self._last_step.pop(id(handle), None)
        self.requests.labels(status=status).inc()

    def rejected(self) -> None:
        """A request the server refused before it reached the engine (a bad field, a full queue, no key)."""
        self.requests.labels(status="rejected").inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
