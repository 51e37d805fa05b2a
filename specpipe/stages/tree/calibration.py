"""A static tree's calibration: how often each top-k path of a drafter's guesses is the target's own
continuation, measured on held-out text (Medusa's tree construction from calibrated head accuracies).

A path (i0, i1, ..., id) is the node reached by taking the i0-th most likely token after the root,
then the i1-th after it, and so on (`tree=static`'s choices). Its probability is the share of
measured positions where the target's next d + 1 tokens after the root were exactly those guesses,
which is the chance that this node lies on the accepted path. So a tree's expected accepted tokens
per step are 1 (the target's own token) plus the sum of its paths' probabilities. A path is never
more likely than its prefix, so the most likely paths form a tree (closed under prefixes).

`task=calibrate_tree` writes the file; `tree=static` with `calibration=FILE` reads it and, every
step, verifies the most likely paths that maximise expected tokens per millisecond on the measured
cost curve.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.types import NO_BUDGET, StepBudget

FORMAT = "specpipe.tree_calibration"
FORMAT_VERSION = 1


def count_paths(ranks: Tensor, max_rank: int) -> Counter:
    """ranks [n, K]: per position, where the target's token after the root, and the ones after it,
    ranked among the guesses of depth 1..K (-1 = not among them at all). Returns how many positions
    matched each path: a position matches every prefix of its ranks, up to the first rank that is -1
    or >= max_rank."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        path: tuple[int, ...] = ()
        for rank in row:
            if rank < 0 or rank >= max_rank:
                break
            path += (rank,)
            counts[path] += 1
    return counts


def ranked_paths(counts: Counter, positions: int, keep: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """The `keep` most frequent paths and their probabilities, most likely first. Ties go to the
    shorter path, then to the lower ranks, so the list stays closed under prefixes."""
    if positions <= 0:
        raise ValueError("no positions were measured")
    ordered = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))[:keep]
    return [path for path, _ in ordered], [count / positions for _, count in ordered]


def write_calibration(path: Path, paths: Sequence[Sequence[int]], probabilities: Sequence[float],
                      info: dict) -> None:
    """The calibration file: the ranked paths and probabilities, with `info` (where they were measured)."""
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **info,
                "paths": [list(p) for p in paths], "probabilities": [round(float(p), 6) for p in probabilities]}
    from specpipe.distill.corpus import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda temporary: Path(temporary).write_text(json.dumps(document, indent=1) + "\n"))


def heads_sha256(folder: Path | None) -> str | None:
    """What a calibration records of the heads it was measured on: the SHA-256 of the folder's first
    .safetensors file (None without one)."""
    from specpipe.stores.manifest import sha256_file

    weights = sorted(folder.glob("*.safetensors")) if folder is not None else []
    return sha256_file(weights[0]) if weights else None


def fits_heads(path: Path, folder: Path) -> bool:
    """Whether the calibration at `path` was measured on the heads in `folder` (`heads_sha256`); True
    where either side has no hash to compare."""
    try:
        recorded = json.loads(path.read_text()).get("heads_sha256")
    except (OSError, json.JSONDecodeError, AttributeError):
        return True  # read_calibration reports what is wrong with the file
    current = heads_sha256(folder)
    return recorded is None or current is None or current == recorded


def read_calibration(path: Path) -> tuple[list[tuple[int, ...]], list[float]]:
    """(paths, probabilities) from a calibration file, checked: most likely first, closed under prefixes."""
    if not path.is_file():
        raise ConfigError(f"tree=static: no tree calibration at {path}: measure one with `python run.py "
                          f"task=calibrate_tree pipeline=medusa` (or hydra), or set pipeline.tree.calibration=null "
                          f"to use pipeline.tree.choices")
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"tree=static: {path} is not JSON ({error})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ConfigError(f"tree=static: {path} is not a tree calibration (format {FORMAT!r} expected)")
    if document.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"tree=static: {path} has format_version {document.get('format_version')}; this "
                          f"specpipe reads {FORMAT_VERSION}: measure it again with task=calibrate_tree")
    paths = [tuple(int(i) for i in p) for p in document.get("paths", [])]
    probabilities = [float(p) for p in document.get("probabilities", [])]
    if not paths or len(paths) != len(probabilities):
        raise ConfigError(f"tree=static: {path} needs as many probabilities as paths (got {len(paths)} paths, "
                          f"{len(probabilities)} probabilities)")
    seen: set[tuple[int, ...]] = set()
    for i, (p, probability) in enumerate(zip(paths, probabilities)):
        if not p or min(p) < 0 or not 0.0 <= probability <= 1.0:
            raise ConfigError(f"tree=static: {path}: entry {i} ({list(p)}, {probability}) is not a path of ranks "
                              f">= 0 with a probability in [0, 1]")
        if i and probability > probabilities[i - 1]:
            raise ConfigError(f"tree=static: {path}: paths must be listed most likely first (entry {i})")
        if p[:-1] and p[:-1] not in seen:
            raise ConfigError(f"tree=static: {path}: path {list(p)} comes before its prefix {list(p[:-1])}")
        seen.add(p)
    return paths, probabilities


def best_size(probabilities: Sequence[float], cost_curve: CostCurve, budget: StepBudget = NO_BUDGET) -> int:
    """How many of the ranked paths to verify: the count that maximises expected tokens per
    millisecond, (1 + their probabilities) / cost of the forward (root + nodes); 0 = a plain step.
    In a batch the tokens and the cost are the whole step's (`budget`: the other sequences)."""
    expected = 1.0 + budget.tokens
    best, best_rate = 0, expected / (cost_curve(1 + budget.rows) + budget.milliseconds)
    for size, probability in enumerate(probabilities, 1):
        expected += probability
        rate = expected / (cost_curve(size + 1 + budget.rows) + budget.milliseconds)
        if rate > best_rate:
            best, best_rate = size, rate
    return best
