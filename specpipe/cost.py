"""The measured cost of one target forward as a function of the number of query tokens.

Speculation pays when the expected tokens per step beat the cost of verifying the tree
relative to a plain one-token step, so draft sizes are chosen from this curve, measured
once per machine, model and dtype and cached on disk.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import specpipe.distributed as distributed
from specpipe.engine.base import REWRITE_ATTRIBUTE, spread_description
from specpipe.engine.cpu import cpu_description
from specpipe.models import cache_root
from specpipe.types import DraftTree

log = logging.getLogger(__name__)

# Dense where trees are chosen: a line from 4 to 8 rows priced 5-7 rows 6-9% over their cost (fp32, 2-core AVX-512 VM).
DEFAULT_QUERIES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds per forward at measured query counts, linearly interpolated between them."""

    queries: tuple[int, ...]
    milliseconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.queries) != len(self.milliseconds) or not self.queries:
            raise ValueError("a cost curve needs one time per query count")
        if list(self.queries) != sorted(set(self.queries)) or self.queries[0] < 1:
            raise ValueError(f"cost curve query counts must be increasing from 1 or more, got {self.queries}")
        # a zero or negative time divides by zero where trees are priced; NaN or inf prices every tree out
        if not all(math.isfinite(ms) and ms > 0 for ms in self.milliseconds):
            raise ValueError(f"cost curve times must be finite and > 0 ms, got {self.milliseconds}")

    @staticmethod
    def flat() -> "CostCurve":
        """Every tree size costs one step: drafts are never cut for cost (tests, idealised runs)."""
        return CostCurve((1,), (1.0,))

    def __call__(self, queries: int) -> float:
        xs, ys = self.queries, self.milliseconds
        if len(xs) == 1 or queries <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if queries <= x1:
                return y0 + (y1 - y0) * (queries - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (queries - xs[-1])

    def to_json(self) -> dict:
        return {"queries": list(self.queries), "milliseconds": list(self.milliseconds)}


class OnlineCostCurve:
    """A measured curve corrected by the times of the steps decoding runs.

    The cached curve keeps the level and the shape of the moment it was measured, while a shared VM's
    speed, and what extra rows cost beside one, move within minutes: a stale curve prices the nodes of
    a tree wrongly for the rest of the run.

    Model: cost(q) = alpha + beta * (base(q) - base(1)). A slower or faster memory moves alpha (every
    forward streams the weights once, whatever its rows), and so do the step's costs outside its
    forward (see `observe`); beta scales what each extra row adds over one. Both are fit by least
    squares over the observed steps, each weighted by its recency (about the last `memory` count),
    with a prior that the measured curve keeps its shape, scaled as a whole (beta = alpha / base(1)),
    worth `prior_weight` forwards, and a far weaker one that alpha = base(1), so that a curve that has
    seen nothing is the measured one. Why scaled: where every step verifies about the same number of
    rows (a static tree), the steps cannot tell alpha from beta, and a prior of beta = 1 would put nearly
    all of a level change on beta: from a curve measured slow at every size, such steps would conclude
    that extra rows cost a fraction of what they do, and trees would grow past what they gain.
    An observation further than `clip` times from the current estimate counts as that bound (a
    page fault, a pause of the VM must not bend the curve).

    Requests decoded in parallel threads share one curve: an update holds a lock, and a reader gets
    alpha and beta of the same fit.
    """

    def __init__(self, base: CostCurve, memory: float = 256.0, prior_weight: float = 2.0,
                 clip: float = 1.5) -> None:
        if memory < 1 or prior_weight <= 0 or clip <= 1:
            raise ValueError(f"online cost curve: memory must be >= 1, prior_weight > 0 and clip > 1; got "
                             f"{memory}, {prior_weight}, {clip}")
        self.base = base
        self.clip = clip
        self._keep = 1.0 - 1.0 / memory
        self._one_row = base(1)
        # the shape prior's weight in units of forwards of a typical tree (4 rows); the level's, a hundredth
        spread = max(base(4) - self._one_row, 0.01 * self._one_row)
        self._alpha_prior = prior_weight / 100.0
        self._beta_prior = prior_weight * spread * spread
        self._sums = [0.0] * 5  # decayed sums of w, w*x, w*y, w*x*x, w*x*y
        self._fit = (self._one_row, 1.0)  # (alpha, beta), replaced as one
        self._lock = threading.Lock()
        self.observations = 0
        # the tree builders price ~30 sizes per step: the base curve's interpolation read from a table
        self._extra = [0.0] + [base(q) - self._one_row for q in range(1, 257)]

    def extra(self, queries: int) -> float:
        """What `queries` rows cost over one row on the base curve (ms)."""
        if 0 <= queries < len(self._extra):
            return self._extra[queries]
        return self.base(queries) - self._one_row

    @property
    def alpha(self) -> float:
        """A one-row step's cost now (ms): the forward and the step's fixed costs."""
        return self._fit[0]

    @property
    def beta(self) -> float:
        """What extra rows cost now, relative to the measured curve."""
        return self._fit[1]

    def __call__(self, queries: int) -> float:
        alpha, beta = self._fit
        return alpha + beta * self.extra(queries)

    def observe(self, queries: int, milliseconds: float) -> None:
        """A step that verified `queries` query rows took `milliseconds`: its verify forward and the
        rest of the step, the draft levels the tree builder priced itself aside (SpeculativeDecoder).
        The fit's alpha then holds the step's fixed costs too, and trees are sized for the whole step."""
        with self._lock:
            self._observe(self.extra(queries), milliseconds)

    def _observe(self, x: float, milliseconds: float) -> None:
        alpha, beta = self._fit
        predicted = alpha + beta * x
        y = min(max(milliseconds, predicted / self.clip), predicted * self.clip)
        keep = self._keep
        sums = self._sums
        for index, value in enumerate((1.0, x, y, x * x, x * y)):
            sums[index] = sums[index] * keep + value
        self.observations += 1
        weight, sum_x, sum_y, sum_xx, sum_xy = sums
        # normal equations of sum w (y - a - b x)^2 + pa (a - base(1))^2 + pb (b - a / base(1))^2
        pa, pb, one_row = self._alpha_prior, self._beta_prior, self._one_row
        a11, a12, a22 = weight + pa + pb / (one_row * one_row), sum_x - pb / one_row, sum_xx + pb
        b1, b2 = sum_y + pa * one_row, sum_xy
        determinant = a11 * a22 - a12 * a12
        alpha = (b1 * a22 - a12 * b2) / determinant
        beta = (a11 * b2 - a12 * b1) / determinant
        # a tree never costs less than its root, nor an extra row less than a twentieth of the measured one
        self._fit = (max(alpha, 0.05 * self._one_row), max(beta, 0.05))


def random_chain(queries: int, vocab: int, generator: torch.Generator) -> DraftTree:
    """A chain of `queries` - 1 random draft tokens: with the root, a forward over `queries` tokens."""
    return DraftTree.from_parents(torch.randint(0, vocab, (queries - 1,), generator=generator),
                                  torch.arange(-1, queries - 2))


def random_branches(queries: int, vocab: int, generator: torch.Generator) -> DraftTree:
    """Two chains of random draft tokens from the root, interleaved (node i's parent is node i - 2), `queries` - 1
    nodes in all: a branched tree, which on AMX CPUs verifies on the tiles where a chain does not
    (specpipe.engine.cpu_kernel.TileRows)."""
    nodes = queries - 1
    return DraftTree.from_parents(torch.randint(0, vocab, (nodes,), generator=generator),
                                  torch.clamp(torch.arange(nodes) - 2, min=-1))


def measure_cost_curve(target, queries: tuple[int, ...] = DEFAULT_QUERIES, kv_length: int = 256,
                       rounds: int = 7, seed: int = 0) -> CostCurve:
    """Median wall time of `target.forward_tree` with a tree of q - 1 nodes in two branches over a kv_length
    cache."""
    return measure_cost_curves([target], queries, kv_length, rounds, seed)[0]


def measure_cost_curves(targets: list, queries: tuple[int, ...] = DEFAULT_QUERIES, kv_length: int = 256,
                        rounds: int = 7, seed: int = 0) -> list[CostCurve]:
    """One curve per target, measured in interleaved rounds: every (target, q) once per round,
    after a warm-up round, so a slow spell of the machine spreads over all targets and sizes
    instead of bending one of them. Targets are anything with `new_cache`, `prefill` and
    `forward_tree` (TargetModel, or a stock forward for comparison).

    Each sample is the second of two forwards of the same size, as in decoding, where a step follows
    steps of about its size. Timed right after the round's largest forward, a one-token forward takes
    longer than it does in decoding: a curve from single forwards prices a few extra rows at about
    nothing, and the tree builders would take extra nodes they do not get for free."""
    generator = torch.Generator().manual_seed(seed)
    vocab = min(target.vocab_size for target in targets)
    context = torch.randint(0, vocab, (kv_length + 1,), generator=generator).tolist()
    caches = []
    for target in targets:
        caches.append(target.new_cache())
        target.prefill(context[:-1], caches[-1])
    # branched: most trees of 7 rows or more that pipelines verify are, and on AMX CPUs those run on the tiles
    trees = {q: random_branches(q, vocab, generator) for q in queries}
    samples = [{q: [] for q in queries} for _ in targets]
    for round_index in range(rounds + 1):
        for target, cache, target_samples in zip(targets, caches, samples):
            for q in queries:
                for _ in range(2):  # the second is timed
                    start = time.perf_counter()
                    target.forward_tree(context[-1], trees[q], cache)
                    if target.device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    cache.crop(kv_length)
                if round_index > 0:  # round 0 warms up
                    target_samples[q].append(elapsed * 1000.0)
    return [CostCurve(tuple(queries), tuple(itertools.accumulate((statistics.median(s[q]) for q in queries), max)))
            for s in samples]  # more rows never cost less: a dip is noise that would pin every tree at its size


def openmp_wait_settings() -> tuple[str, str]:
    """How OpenMP's worker threads wait between parallel regions (OMP_WAIT_POLICY, GOMP_SPINCOUNT).

    Part of a CPU curve's key: threads that sleep wake late for every parallel region, so every forward
    costs more under OMP_WAIT_POLICY=PASSIVE. The test suite runs PASSIVE: keyed alike, the curves it
    caches would size the trees of the runs without it."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper(), os.environ.get("GOMP_SPINCOUNT", "").strip()


def _machine_key(target, kv_length: int) -> str:
    parts = [target.name, getattr(target, "engine", "hf"), getattr(target, "attn_implementation", "sdpa"),
             str(target.dtype), target.device.type, platform.machine(), platform.processor(),
             str(torch.get_num_threads()), torch.__version__, str(kv_length), str(os.cpu_count())]
    model = getattr(target, "model", None)
    spread = spread_description(model) if model is not None else None
    if spread is not None:  # a device map, a quantized or a sharded model costs what its placement makes it
        parts += [spread, str(getattr(model, "hf_device_map", "")), f"world={distributed.world_size()}"]
    if target.device.type == "cuda":
        parts.append(torch.cuda.get_device_name(target.device))
    else:  # one CPU model string can hide an ISA cap (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS)
        description = cpu_description()
        parts += [description["cpu_model"], description["aten_capability"], json.dumps(description["onednn_linear"]),
                  description["mkl_enable_instructions"],
                  str(getattr(getattr(target, "model", None), REWRITE_ATTRIBUTE, "")), *openmp_wait_settings()]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def cost_curve_path(target, kv_length: int = 256, cache_dir: Path | None = None) -> Path:
    folder = (cache_dir or cache_root()) / "cost"
    # v3: draft runners' output layers run under the engine since (v2 curves overstate their cost);
    # v4: EAGLE heads over a reduced vocabulary take their log-softmax over it, not the whole vocabulary;
    # v5: each sample is the second of two forwards of its size (v4 overpriced one-token forwards);
    # v6: measured at 3, 5, 6 and 12 rows too (linear from 4 to 8 rows overpriced 5-7 rows)
    # v7: cached only when measured on a quiet machine (one measured beside another job prices every size alike)
    # v8: measured over trees of two branches, not chains (on AMX CPUs only branched trees verify on the tiles)
    return folder / f"{target.name}-{_machine_key(target, kv_length)}-v8.json"


def store_cost_curve(target, curve: CostCurve, kv_length: int = 256, cache_dir: Path | None = None) -> Path:
    """Writes the curve where `cached_cost_curve` looks for it (atomically: runs may share the cache)."""
    path = cost_curve_path(target, kv_length, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(curve.to_json(), indent=1))
    staging.replace(path)
    return path


def cached_cost_curve(target, kv_length: int = 256, cache_dir: Path | None = None) -> CostCurve:
    """The curve for this machine/model/engine/dtype: measured once (a few seconds), then read from disk.

    A curve measured while other processes competed for this process's CPUs is used by this run
    only and measured again by the next (see `OtherProcessesLoad`). Under tensor parallel every rank
    measures (each forward is a collective) but all use rank 0's curve, read or measured there: tree
    sizes drawn from per-rank timings would differ and the ranks' verify forwards would no longer match.
    """
    curve = distributed.broadcast_from_main(read_cost_curve(target, kv_length, cache_dir))
    if curve is None:
        with OtherProcessesLoad() as load:
            measured = measure_cost_curve(target, kv_length=kv_length)
        curve = distributed.broadcast_from_main(measured)
        if load.competed():
            log.warning("the cost curve of %s (%s) is not cached: other processes kept %.1f of the %d CPUs this "
                        "process may use busy while it was measured (one-token forward %.1f ms then). This run "
                        "sizes its trees by it; the next run measures it again.", target.name, target.dtype,
                        load.cores, load.cpus, curve(1))
        elif distributed.is_main_process():
            store_cost_curve(target, curve, kv_length, cache_dir)
    return curve


class OtherProcessesLoad:
    """How many CPUs other processes kept busy while a block ran, counted on the CPUs this process may
    run on (its affinity), the hypervisor's steal time included; Linux's /proc/stat, and nothing
    (`cores` None) where it cannot be read.

    Why: a cost curve measured while another job competed for the cores prices every tree by that
    moment: a forward then waits for the cores, whatever its rows, so the curve is flat, and cached it
    would have every later run build trees it believes free."""

    def __init__(self, stat_path: Path = Path("/proc/stat"), cpus: set[int] | None = None,
                 margin: float = 0.25) -> None:
        self.stat_path = stat_path
        self.cpu_ids = cpus if cpus is not None else _affinity()
        self.margin = margin  # an idle VM's daemons keep ~0.02 of a CPU busy
        self.cores: float | None = None  # CPUs kept busy by others, on average over the block

    @property
    def cpus(self) -> int:
        return len(self.cpu_ids)

    def __enter__(self) -> "OtherProcessesLoad":
        self._start = self._sample()
        return self

    def __exit__(self, *exc_info) -> None:
        end = self._sample()
        if self._start is not None and end is not None:
            (wall0, busy0, own0), (wall1, busy1, own1) = self._start, end
            self.cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)

    def competed(self, threads: int | None = None) -> bool:
        """Whether others used more CPUs than those the block's `threads` (None: torch's) left free. Never
        under tensor parallel: the other ranks are other processes on these CPUs, by design."""
        if self.cores is None or distributed.active():
            return False
        threads = torch.get_num_threads() if threads is None else threads
        return self.cores > max(self.cpus - threads, 0) + self.margin

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall s, busy CPU s on our CPUs by everyone, this process's CPU s)"""
        try:
            ticks_per_second = os.sysconf("SC_CLK_TCK")
            busy = 0
            for line in self.stat_path.read_text().splitlines():
                fields = line.split()
                # cpuN user nice system idle iowait irq softirq steal ...: guest time is inside user
                if fields and fields[0].startswith("cpu") and fields[0][3:].isdigit() \
                        and int(fields[0][3:]) in self.cpu_ids:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
                    busy += user + nice + system + irq + softirq + steal
        except (OSError, ValueError, AttributeError):
            return None
        own = os.times()
        return time.monotonic(), busy / ticks_per_second, own.user + own.system


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux: /proc/stat is not read either
        return set(range(os.cpu_count() or 1))


def read_cost_curve(target, kv_length: int = 256, cache_dir: Path | None = None) -> CostCurve | None:
    """The cached curve, or None when there is none yet (or it cannot be read: logged)."""
    path = cost_curve_path(target, kv_length, cache_dir)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            return CostCurve(tuple(int(q) for q in data["queries"]), tuple(float(ms) for ms in data["milliseconds"]))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            log.warning("the cached cost curve %s cannot be read (%s: %s); measuring it again", path,
                        type(error).__name__, error)
    return None


def measure_read_bandwidth(megabytes: int = 256, rounds: int = 7) -> float:
    """GB/s reading a `megabytes` fp32 tensor with torch's threads (median over rounds, after one warm-up).

    A one-token decoding step on a CPU streams every weight from memory once, so the weight bytes
    over this bandwidth are the physical floor of a step: no engine can beat it.
    """
    data = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)  # [elements]
    data.sum()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        samples.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(samples) / 1e9


def streamed_weight_bytes(model: torch.nn.Module, rows: int = 1) -> int:
    """Bytes of weights a forward of `rows` query tokens reads: every parameter or prepacked weight
    once, embedding tables not at all (a lookup reads a row; a tied output layer reads the table as
    its own weight)."""
    from specpipe.engine.packed_weight import PackedWeight

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        if isinstance(module, PackedWeight):
            if id(module) not in seen:
                seen.add(id(module))
                total += module.weight_bytes(rows)
            continue
        for tensor in module.parameters(recurse=False):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total
