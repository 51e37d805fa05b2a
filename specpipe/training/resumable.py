"""The training tasks' plumbing (task=distill_draft, task=train_heads; the setting checks also serve the tasks that
only read a corpus): per-example arrays cached in .npy shards, seeded batches packed by length, and a trainer that
checkpoints and resumes."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from specpipe.distill.corpus import write_atomically
from specpipe.engine.cpu import onednn_available, pack_weight, packed_linear
from specpipe.errors import ConfigError


def progress_bar(enabled: bool, **kwargs):
    """A tqdm bar on stderr (None when disabled); in a log file (nohup) one line a minute, not a redraw a second."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(mininterval=1.0 if sys.stderr.isatty() else 60.0, dynamic_ncols=True, **kwargs)


def lock_folder(folder: Path, task: str):
    """An exclusive lock on a task's checkpoint folder for the whole run (released when the process
    ends): two runs would write the same shards and checkpoints."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        raise ConfigError(f"another task={task} run (pid {handle.read().strip() or '?'}) is using {folder}; "
                          f"wait for it to end, or set {task}.checkpoint_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


# Settings the training and scoring tasks share, and what each must be: a value outside is refused before
# any feature or teacher pass runs (steps=-3 ran and exported, lr=-1 failed after the feature pass,
# checkpoint_every=0 after the first step).
AT_LEAST_ONE = (lambda v: v >= 1, ">= 1")
TASK_SETTING_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "steps": (lambda v: v >= 0, ">= 0 (0: export the head or draft as initialised)"),
    "batch": (lambda v: v >= 1, ">= 1 (tokens per step)"),
    "lr": (lambda v: v > 0, "> 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "warmup": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "grad_clip": (lambda v: v > 0, "> 0"),
    "checkpoint_every": AT_LEAST_ONE,
    "keep_checkpoints": AT_LEAST_ONE,
    "eval_every": (lambda v: v >= 0, ">= 0"),
    "eval_chains": AT_LEAST_ONE,
    "chain_depth": AT_LEAST_ONE,
    "eval_fraction": (lambda v: 0 < v < 1, "between 0 and 1 (the held-out share)"),
    "limit": (lambda v: v >= 1, ">= 1, or null for the whole corpus"),
    "max_seq_len": (lambda v: v >= 2, ">= 2 (prompt + answer tokens per sequence)"),
}


# Tasks that only score held-out answers (calibrate_tree, search_layers) may hold all of them out.
SCORED_SHARE_RULE = {"eval_fraction": (lambda v: 0 < v <= 1, "in (0, 1] (the share of answers scored; 1: all)")}


def check_task_settings(node: Mapping[str, object], prefix: str,
                        extra: dict[str, tuple[Callable[[float], bool], str]] | None = None) -> None:
    """Refuses a task's settings outside their rules (TASK_SETTING_RULES, for the keys the task has, and
    `extra`), naming `prefix.key`; a null setting is left to the task (limit: the whole corpus)."""
    for key, (ok, what) in {**TASK_SETTING_RULES, **(extra or {})}.items():
        value = node.get(key)
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{prefix}.{key} must be a number {what}, got {value!r}") from None
        if not ok(number):
            raise ConfigError(f"{prefix}.{key} must be {what}, got {value}")


def check_folder(folder: Path, option: str) -> None:
    """Refuses a checkpoint folder that is a file (it would fail at the first write)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{option}={folder} is a file: give a folder (it is made where missing)")


def check_output_file(path: Path, option: str, example_name: str) -> None:
    """Refuses an output file that is a folder, or whose folder is a file, before any long pass: the write
    comes last, and an IsADirectoryError then would throw the task's work away."""
    if path.is_dir():
        raise ConfigError(f"{option}={path} is a folder: give a file, e.g. {option}={path / example_name}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{option}={path}: {parent} is a file, not a folder")
            break


def finished_message(prefix: str, step: int, steps: int) -> str | None:
    """What a rerun after the end says (it trains nothing; without this it said only "resumed from step N")."""
    if step < steps:
        return None
    return (f"nothing left to train: the checkpoint is at step {step} and {prefix}.steps={steps} "
            f"(raise {prefix}.steps to train on)")


def save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
    write_atomically(path, write)


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n"))


def token_batches(lengths: Sequence[int], batch_tokens: int, window: int = 64) -> list[list[int]]:
    """Indices into `lengths` (tokens per example) in batches of at most `batch_tokens` padded tokens
    (one example at least); each window of `window` examples is sorted by length first so batches
    pad little."""
    batches = []
    for start in range(0, len(lengths), window):
        chunk = sorted(range(start, min(start + window, len(lengths))), key=lambda i: (lengths[i], i))
        current: list[int] = []
        for i in chunk:
            width = max([lengths[j] for j in current] + [lengths[i]])
            if current and width * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    return batches


class ExampleShards:
    """Arrays of rows per example, in shards of whole examples: `{prefix}-NNNNNN.{name}.npy` for each
    of `arrays`, `.len.npy` (rows per example) and `.pid.npy` (prompt ids). The pid file is written
    last: a shard without it is unfinished, ignored, then overwritten. `settings` pinned beside them
    (e.g. the model and dtype they came from) must match on every later run."""

    def __init__(self, folder: Path, prefix: str, arrays: tuple[str, ...], task: str) -> None:
        self.folder, self.prefix, self.arrays, self.task = Path(folder), prefix, arrays, task

    def pin(self, settings: dict) -> None:
        path = self.folder / "settings.json"
        if path.is_file() and self.shards():
            pinned = json.loads(path.read_text())
            if pinned != settings:
                differing = sorted(k for k in set(pinned) | set(settings) if pinned.get(k) != settings.get(k))
                raise ConfigError(f"the {self.prefix} arrays in {self.folder} were computed with other settings "
                                  f"({', '.join(differing)}): delete that folder, or set {self.task}.checkpoint_dir")
        write_json(path, settings)

    def shards(self) -> list[str]:
        return sorted(p.name[: -len(".pid.npy")] for p in self.folder.glob(f"{self.prefix}-*.pid.npy"))

    def done(self) -> dict[str, int]:
        """prompt id -> rows cached for it (the latest shard's, which is the one `load` returns)."""
        done: dict[str, int] = {}
        for shard in self.shards():
            pids = np.load(self.folder / f"{shard}.pid.npy", allow_pickle=False).tolist()
            done.update(zip(pids, np.load(self.folder / f"{shard}.len.npy", allow_pickle=False).tolist()))
        return done

    def next_index(self) -> int:
        """The next shard's number; leftovers of an interrupted write are removed first."""
        for path in self.folder.glob(".tmp-*"):
            path.unlink(missing_ok=True)
        return max((int(s.split("-")[1]) for s in self.shards()), default=-1) + 1

    def write(self, index: int, prompt_ids: Sequence[str], rows: Sequence[int], arrays: dict[str, np.ndarray]) -> None:
        stem = self.folder / f"{self.prefix}-{index:06d}"
        for name in self.arrays:
            save_npy(stem.with_name(f"{stem.name}.{name}.npy"), arrays[name])
        save_npy(stem.with_name(f"{stem.name}.len.npy"), np.asarray(rows, np.int64))
        save_npy(stem.with_name(f"{stem.name}.pid.npy"), np.asarray(list(prompt_ids)))

    def load(self, mmap: bool = False) -> dict[str, tuple[np.ndarray, ...]]:
        """prompt id -> one array per name of `arrays`, each [rows, ...] (memory-mapped with `mmap`)."""
        out = {}
        for shard in self.shards():
            arrays = [np.load(self.folder / f"{shard}.{name}.npy", allow_pickle=False, mmap_mode="r" if mmap else None)
                      for name in self.arrays]
            lengths = np.load(self.folder / f"{shard}.len.npy", allow_pickle=False)
            pids = np.load(self.folder / f"{shard}.pid.npy", allow_pickle=False)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            if any(len(array) != offsets[-1] for array in arrays):
                raise ConfigError(f"{self.prefix} shard {self.folder / shard} is inconsistent; delete its files and rerun")
            for i, pid in enumerate(pids.tolist()):  # a later shard's rows replace an earlier one's
                out[pid] = tuple(array[offsets[i]:offsets[i + 1]] for array in arrays)
        return out


class ResumableTrainer:
    """AdamW over `params`, batches that are a function of (seed, step) alone (an epoch is a seeded
    shuffle of the examples packed by length, so a resumed run sees what it would have seen), and
    checkpoints every `checkpoint_every` steps (`checkpoint-*.pt`, tensors only, the last
    `keep_checkpoints` kept). Checkpoints hold `module`'s state under `state_key`, the optimizer's,
    and the counters (`step`, `positions`, `seconds` and the subclass's `extra_counters`)."""

    state_key = "net"
    extra_counters: tuple[str, ...] = ()
    # Settings a resumed run may change: how long it trains, how often it evaluates and saves, where it
    # writes, and what only changes float rounding or which answers it reads (a grown corpus). Any other
    # setting differing from the checkpoints' is refused: a resumed head of another shape failed in
    # load_state_dict, and one of other layers or batches trained on silently, its export recording the
    # new settings.
    RESUMABLE_SETTINGS = frozenset({"steps", "eval_every", "eval_init", "eval_chains", "chain_depth", "eval_batch",
                                    "checkpoint_every", "keep_checkpoints", "progress", "out", "checkpoint_dir",
                                    "teacher_only", "feature_batch", "teacher_batch", "loss_chunk", "corpus", "limit",
                                    "eval_of", "eagle_layers"})

    def __init__(self, module: torch.nn.Module, examples: list, lengths: Callable[[object], int],
                 task_settings: Mapping[str, object], folder: Path, params=None) -> None:
        # the task's settings as plain values (the task resolves its config node into them)
        self.task_settings, self.module, self.examples, self.folder = dict(task_settings), module, examples, Path(folder)
        self.lengths = [lengths(example) for example in examples]
        self.params = list(params if params is not None else module.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=float(self.task_settings["lr"]),
                                           betas=(0.9, 0.95), weight_decay=float(self.task_settings["weight_decay"]))
        self.step, self.positions, self.seconds = 0, 0, 0.0
        for name in self.extra_counters:
            setattr(self, name, 0)
        self._epoch_cache: tuple[int, list] | None = None

    def batch_at(self, step: int) -> list:
        epoch, index = 0, step
        while True:
            batches = self._epoch(epoch)
            if index < len(batches):
                return [self.examples[i] for i in batches[index]]
            index -= len(batches)
            epoch += 1

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([int(self.task_settings["seed"]), epoch])
        order = rng.permutation(len(self.examples))
        batches = [[int(order[i]) for i in batch]
                   for batch in token_batches([self.lengths[i] for i in order], int(self.task_settings["batch"]))]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        self._epoch_cache = (epoch, batches)
        return batches

    def epochs(self) -> float:
        return self.step / max(1, len(self._epoch(0)))

    def settings(self) -> dict[str, str]:
        """The task settings this run's checkpoints must share with a run that resumes them."""
        return {key: json.dumps(value, sort_keys=True, default=str)
                for key, value in self.task_settings.items()
                if key not in self.RESUMABLE_SETTINGS}

    def checkpoints(self) -> list[Path]:
        return sorted(self.folder.glob("checkpoint-*.pt"))

    def resume(self, log: Callable[[str], None] = print) -> bool:
        for path in reversed(self.checkpoints()):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:  # a truncated file: fall back to the one before
                log(f"checkpoint {path} unreadable ({str(error).splitlines()[0]}); trying an older one")
                continue
            saved, current = state.get("settings"), self.settings()  # checkpoints before settings: none saved
            if saved is not None and saved != current:
                said = ", ".join(f"{key}={saved.get(key, 'unset')} there, {current.get(key, 'unset')} now"
                                 for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key))
                raise ConfigError(f"the checkpoints in {self.folder} were written with other settings ({said}): "
                                  f"rerun with theirs to resume, or give another checkpoint_dir to start afresh")
            try:
                self.module.load_state_dict(state[self.state_key])
                self.optimizer.load_state_dict(state["optimizer"])
            except (RuntimeError, ValueError, KeyError) as error:
                raise ConfigError(f"the checkpoint {path} does not fit this run's model "
                                  f"({str(error).splitlines()[0]}): give another checkpoint_dir to start afresh") from None
            self.step, self.positions, self.seconds = int(state["step"]), int(state["positions"]), float(state["seconds"])
            for name in self.extra_counters:
                setattr(self, name, int(state[name]))
            return True
        return False

    def save(self) -> Path:
        path = self.folder / f"checkpoint-{self.step:06d}.pt"
        state = {self.state_key: self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "positions": self.positions, "seconds": self.seconds, "settings": self.settings(),
                 **{name: getattr(self, name) for name in self.extra_counters}}
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: torch.save(state, tmp))
        for old in self.checkpoints()[: -int(self.task_settings["keep_checkpoints"])]:
            old.unlink(missing_ok=True)
        return path


class _FrozenProduct(torch.autograd.Function):
    """x @ W^T through oneDNN, with the gradient to x only (W is frozen): grad @ W, through W^T's packing."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, packed: torch.Tensor, packed_transposed: torch.Tensor) -> torch.Tensor:
        ctx.packed_transposed = packed_transposed
        return packed_linear(rows, packed, None)  # [n, out]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return packed_linear(grad.contiguous(), ctx.packed_transposed, None), None, None  # [n, in]


class FrozenPackedLinear(torch.nn.Module):
    """A frozen, bias-free fp32 linear layer for training losses on the CPU: its product and the product of
    its backward pass (to the input) run oneDNN's prepacked kernels. torch's own matmul goes to MKL, which
    runs its AVX2 code on AMD CPUs, about half as fast there for the embedded model's output layer (49152 x 576)
    over 1024 rows, forward and backward. Holds two packings of the weight (it and its transpose)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        weight = weight.detach()
        self.packed = pack_weight(weight)  # [out, in] blocked
        self.packed_transposed = pack_weight(weight.t().contiguous())  # [in, out] blocked

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return _FrozenProduct.apply(rows.contiguous(), self.packed, self.packed_transposed)


def frozen_product(weight: torch.Tensor) -> torch.nn.Module:
    """rows [n, in] -> rows @ weight.T [n, out] for a training loss, weight [out, in] frozen: as
    `frozen_loss_head` runs it (oneDNN's packed kernels where they serve)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    return frozen_loss_head(linear)


def frozen_loss_head(linear: torch.nn.Linear) -> torch.nn.Module:
    """The output layer a training loss should run: `linear` as a FrozenPackedLinear where oneDNN can pack
    it (a frozen fp32 weight without a bias, on the CPU), else `linear` itself."""
    weight = linear.weight
    if (linear.bias is not None or weight.requires_grad or weight.dtype != torch.float32
            or weight.device.type != "cpu" or not onednn_available()):
        return linear
    try:
        return FrozenPackedLinear(weight)
    except RuntimeError:  # no oneDNN path for this CPU: torch's own product serves
        return linear
