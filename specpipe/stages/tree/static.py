"""A static sparse tree (Medusa's, EAGLE-1's): fixed top-k choices per depth over each drafter."""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from specpipe.cost import CostCurve
from specpipe.errors import ConfigError
from specpipe.paths import PACKAGE_ROOT
from specpipe.stages.base import StepDrafter, TreeBuilder, draft_token_ids
from specpipe.stages.tree.calibration import best_size, fits_heads, read_calibration
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.types import DecodeState, DraftTree, Proposal

ROOT = -1
log = logging.getLogger(__name__)


class StaticTreeBuilder(TreeBuilder):
    """Expands each drafter along `choices`: a path (i0, i1, ..., id) is the node reached by taking the
    i0-th most likely token after the root, then the i1-th most likely after that one, and so on
    (Medusa's `medusa_choices`). Every listed node is drafted and verified, whatever the measured cost
    of the forward: the tree's shape is the configuration. Other sources' proposals are merged in
    the same trie (a node proposed twice is verified once).

    With `calibration` (a file from `task=calibrate_tree`: the paths ranked by how often each was the
    target's own continuation), the choices are instead the most likely `max_nodes` paths, and each
    step verifies as many of them as maximise expected tokens per millisecond on the cost curve.
    `calibration="auto"` reads `tree.json` from the checkpoint folder of the first drafter that has
    one (where the task writes it) and keeps `choices` for drafters without.
    """

    expands_drafters = True
    AUTO = "auto"
    CALIBRATION_FILE = "tree.json"

    def __init__(self, choices: Sequence[Sequence[int]] = (), cost_curve: CostCurve | None = None,
                 calibration: str | None = None, max_nodes: int = 64) -> None:
        if max_nodes < 1:
            raise ConfigError(f"tree=static: pipeline.tree.max_nodes must be >= 1, got {max_nodes}")
        self.max_nodes = max_nodes
        self.cost_curve = cost_curve or CostCurve.flat()
        self.probabilities: list[float] | None = None  # [n] per ranked path, with a calibration
        self.ranked: list[tuple[int, ...]] = []  # the calibrated paths, most likely first
        self._auto = calibration == self.AUTO  # resolved at the first build, which sees the drafters
        self.choices = self._checked(choices) if choices or calibration in (None, self.AUTO) else []
        if calibration is not None and not self._auto:
            self._calibrate(PACKAGE_ROOT / Path(calibration).expanduser())
        self.merger = TrieTreeBuilder(CostCurve.flat(), max_nodes=len(self.choices) + 256, min_gain=0.0)

    @staticmethod
    def _checked(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The paths, parents before children, checked to form a tree."""
        paths = [tuple(int(i) for i in path) for path in choices]
        if not paths or any(not path or min(path) < 0 for path in paths):
            raise ConfigError(f"tree=static: choices must be non-empty paths of top-k indices >= 0, got {list(choices)}")
        listed = set(paths)
        for path in paths:
            if path[:-1] and path[:-1] not in listed:
                raise ConfigError(f"tree=static: choice {list(path)} has no parent {list(path[:-1])} in the list: "
                                  f"a tree needs every prefix of its paths")
        return sorted(listed, key=lambda path: (len(path), path))

    def _calibrate(self, path: Path) -> None:
        ranked, probabilities = read_calibration(path)
        self.ranked, self.probabilities = ranked[: self.max_nodes], probabilities[: self.max_nodes]
        self.choices = self._checked(self.ranked)
        log.info("tree=static: the %d most likely paths of %s, as many per step as the cost curve pays for",
                 len(self.ranked), path)

    def attach(self, drafters: list[StepDrafter]) -> None:
        """Resolves `calibration=auto` from the drafters' checkpoint folders. The pipeline builder calls it
        once the drafters exist, so that what it logs comes before any answer streams; `build` calls it
        at its first step otherwise."""
        if self._auto:
            self._auto = False
            folders = [d.folder for d in drafters]
            found = [f / self.CALIBRATION_FILE for f in folders if f is not None and (f / self.CALIBRATION_FILE).is_file()]
            if found and not fits_heads(found[0], found[0].parent):
                log.warning("tree=static: %s was measured on other heads than those beside it; drafting along "
                            "pipeline.tree.choices instead (measure it again with task=calibrate_tree)", found[0])
                found = []
            if found:
                self._calibrate(found[0])
            elif not self.choices:
                raise ConfigError(f"tree=static calibration=auto: no {self.CALIBRATION_FILE} in the drafters' "
                                  f"checkpoint folders and no choices: measure one with task=calibrate_tree")

    def build(self, state: DecodeState, proposals: list[Proposal], drafters: list[StepDrafter] = ()) -> DraftTree:
        self.attach(drafters)
        choices = self.choices
        if self.probabilities is not None:
            size = best_size(self.probabilities, self.cost_curve, state.budget)
            choices = sorted(self.ranked[:size], key=lambda path: (len(path), path))
        grown = [self.grow(state, drafter, choices) for drafter in drafters] if choices else []
        return self.merger.build(state, [*proposals, *grown])

    def grow(self, state: DecodeState, drafter: StepDrafter, choices: list[tuple[int, ...]] | None = None) -> Proposal:
        """The drafter's tree over `choices` (default: all of them; parents listed before children;
        scores: the product of the draft's probabilities on the path)."""
        choices = self.choices if choices is None else choices
        drafter.start(state)
        draft_vocab = drafter.draft_vocab  # [k] target ids of the columns, or None
        node_of: dict[tuple[int, ...], int] = {(): ROOT}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depth = 1
        while True:
            level = [path for path in choices if len(path) == depth]
            if not level:
                break
            expanded = sorted({path[:-1] for path in level}, key=lambda path: node_of[path])
            frontier = [node_of[path] for path in expanded]
            logprobs = drafter.step(state, tokens, parents, frontier).float()  # [m, vocab] or [m, k]
            width = 1 + max(path[-1] for path in level)
            top = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)  # [m, width] each
            chosen = draft_token_ids(top.indices, draft_vocab)  # [m, width]
            row_of = {path: row for row, path in enumerate(expanded)}
            for path in level:
                row, rank = row_of[path[:-1]], path[-1]
                if rank >= top.indices.shape[1] or not math.isfinite(float(top.values[row, rank])):
                    continue  # the drafter has no such candidate here (e.g. past Medusa's last head)
                parent = node_of[path[:-1]]
                node_of[path] = len(tokens)
                tokens.append(int(chosen[row, rank]))
                parents.append(parent)
                parent_score = scores[parent] if parent != ROOT else 1.0
                scores.append(parent_score * math.exp(float(top.values[row, rank])))
            depth += 1
            if not any(path in node_of for path in level):
                break
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                        scores=torch.tensor(scores, dtype=torch.float32), source=drafter.name)
