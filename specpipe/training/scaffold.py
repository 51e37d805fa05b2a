"""The loop every training task runs, whatever it trains: the corpus read and split into training and held-out
answers, a trainer that steps on warmup + cosine decay and resumes from its last checkpoint, evals on the
held-out answers that also export the trained weights with a record of the run (corpus, training counters and
settings, eval), and report.json beside the checkpoints. A task supplies the trainer, the eval, the export and
what it counts between checkpoints (`TrainingRun`'s methods and a `Window`); the rest is here once, so both
tasks resume, log and export alike."""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specpipe.training.resumable import ResumableTrainer, finished_message, progress_bar, write_json
from specpipe.errors import ConfigError
from specpipe.stores.manifest import sha256_file
from specpipe.training.examples import Example, read_task_corpus, split_held_out


def task_log(task: str) -> Callable[[str], None]:
    """A task's log: one line on stderr, prefixed with the task's name."""
    def log(message: str) -> None:
        print(f"{task}: {message}", file=sys.stderr, flush=True)
    return log


def lr_at(step: int, lr: float, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to lr * min_ratio at `steps` (held after)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- corpus -> split ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusSplit:
    """The corpus answers a run reads (`examples`), split into `train` and `held_out` by `split_held_out`."""

    path: Path                # the corpus file
    setting: str              # the corpus as the task's settings name it (what the export records)
    examples: list[Example]
    train: list[Example]
    held_out: list[Example]
    system_prompt: str | None
    eval_fraction: float

    def summary(self) -> str:
        return (f"{len(self.train)} training / {len(self.held_out)} held-out answers "
                f"({sum(e.n_pred for e in self.train)} / {sum(e.n_pred for e in self.held_out)} answer positions)")

    def record(self) -> dict:
        """The corpus as an export records it."""
        return {"file": self.setting, "sha256": sha256_file(self.path), "answers": len(self.examples),
                "held_out_answers": len(self.held_out), "eval_fraction": self.eval_fraction}


def read_split(path: Path, setting: str, option: str, tokenizer, vocab_sha256: str, model_name: str, max_seq_len: int,
               default_system_prompt: str | None, limit: int | None, eval_fraction: float,
               usable: Callable[[Example], bool] | None = None) -> CorpusSplit:
    """The corpus at `path` (`read_task_corpus`; `option` names its setting in errors): the `usable` answers,
    the first `limit` of them where given, split at `eval_fraction`. Refused when either side is empty."""
    examples, system_prompt = read_task_corpus(path, option, tokenizer, vocab_sha256, model_name, max_seq_len,
                                               default_system_prompt)
    if usable is not None:
        examples = [e for e in examples if usable(e)]
    if limit:
        examples = examples[:limit]
    train, held_out = split_held_out(examples, eval_fraction)
    if not train or not held_out:
        raise ConfigError(f"the corpus {path} gives {len(train)} training and {len(held_out)} held-out answers "
                          f"(eval_fraction={eval_fraction}): both must be non-empty")
    return CorpusSplit(path, setting, examples, train, held_out, system_prompt, eval_fraction)


# ---- the trainer and its loop -------------------------------------------------------------------
class StepTrainer(ResumableTrainer):
    """A ResumableTrainer for `TrainingRun`: `train_step()` takes one optimizer step on the batch `batch_at(step)`
    at `lr_at`'s rate and returns its stats (a task's own, for its `Window`), and the counters it adds to an
    eval (`eval_counters`), to the export's training record (`record_counters`) and to the resume message."""

    def train_step(self) -> dict:
        raise NotImplementedError

    def eval_counters(self) -> dict:
        raise NotImplementedError

    def record_counters(self) -> dict:
        raise NotImplementedError

    def resumed_note(self) -> str:
        return ""

    def apply_schedule(self) -> None:
        """This step's learning rate (warmup, then cosine decay) on every parameter group."""
        given = self.task_settings
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, float(given["lr"]), int(given["warmup"]), int(given["steps"]),
                                float(given["min_lr_ratio"]))

    def optimizer_step(self) -> None:
        """The gradients clipped to `grad_clip`, one AdamW step, the gradients dropped."""
        torch.nn.utils.clip_grad_norm_(self.params, float(self.task_settings["grad_clip"]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Window:
    """What a task counts over the steps since its last checkpoint: `add` takes each step's stats, `postfix`
    is the progress bar's, `checkpoint` the train-log entry and the log line at a checkpoint; `restart` opens
    a new window (after a checkpoint), `after_eval` restarts the clock (an eval's time is no training time)."""

    def restart(self) -> None:
        raise NotImplementedError

    def add(self, stats: dict) -> None:
        raise NotImplementedError

    def postfix(self) -> dict[str, str]:
        raise NotImplementedError

    def checkpoint(self, step: int) -> tuple[dict, str]:
        raise NotImplementedError

    def after_eval(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Schedule:
    """How long a run trains (`steps`), how often it checkpoints and evaluates (`eval_every` 0: at the end
    only; each eval exports), whether it evaluates the untrained weights once (`eval_init`), and whether it
    draws progress bars."""

    steps: int
    checkpoint_every: int
    eval_every: int
    eval_init: bool
    progress: bool


@dataclass(frozen=True)
class Records:
    """What a run writes beside its numbers: `report`, report.json's fields (model, command, settings, ...);
    `export`, the exported record's leading fields (the target, the command, ...); `training`, the settings
    its training record lists after the counters and the loss."""

    report: dict
    export: dict
    training: dict


class TrainingRun:
    """A task's run over `trainer` (its checkpoints and report.json in `trainer.folder`): resumed by `start`,
    trained and evaluated by `train`, which exports to `out` at every eval and once more at the end where
    `out` does not hold this step's weights. A task's subclass gives `evaluate` (on the held-out answers),
    `describe` (an eval's log lines), `export` and `exported_current`."""

    def __init__(self, trainer: StepTrainer, task: str, schedule: Schedule, split: CorpusSplit, out: Path,
                 records: Records, window: Window, log: Callable[[str], None]) -> None:
        self.trainer, self.task, self.schedule, self.split, self.out = trainer, task, schedule, split, out
        self.records, self.window, self.log = records, window, log
        self.report_path = trainer.folder / "report.json"
        self.report: dict = {"evals": []}

    def evaluate(self) -> dict:
        raise NotImplementedError

    def describe(self, result: dict) -> str:
        raise NotImplementedError

    def export(self, result: dict) -> None:
        raise NotImplementedError

    def exported_current(self) -> bool:
        """Whether `out` holds the weights of this step (then a rerun after the end exports nothing)."""
        raise NotImplementedError

    def export_record(self, result: dict, loss: str, eval_keys: Sequence[str]) -> dict:
        """What an export records: the task's fields, the corpus, the training (counters, `loss`, settings) and
        the eval's `eval_keys`."""
        trainer = self.trainer
        training = {"steps": trainer.step, **trainer.record_counters(), "answer_positions": trainer.positions,
                    "seconds": round(trainer.seconds, 1), "loss": loss, **self.records.training}
        return {**self.records.export, "corpus": self.split.record(), "training": training,
                "eval": {key: result[key] for key in eval_keys}}

    def start(self) -> None:
        """Resumes from the last checkpoint (saying so, and when there is nothing left to train), reads report.json."""
        trainer = self.trainer
        if trainer.resume(self.log):
            self.log(f"resumed from step {trainer.step}{trainer.resumed_note()}")
            if finished := finished_message(self.task, trainer.step, self.schedule.steps):
                self.log(finished)
        if self.report_path.is_file():
            self.report = json.loads(self.report_path.read_text())

    def run_eval(self, export: bool) -> dict:
        trainer = self.trainer
        result = self.evaluate()
        result.update(step=trainer.step, **trainer.eval_counters(), positions_trained=trainer.positions,
                      train_seconds=round(trainer.seconds, 1))
        self.log(self.describe(result))
        self.report["evals"] = [r for r in self.report["evals"] if r["step"] != trainer.step] + [result]
        self.report.update(self.records.report)
        write_json(self.report_path, self.report)
        if export:
            self.export(result)
        return result

    def train(self) -> dict:
        """The steps left, a checkpoint every `checkpoint_every` (and at the end) with a train-log entry, an
        eval and export every `eval_every`; then the final eval and export unless `out` already holds them."""
        trainer, schedule = self.trainer, self.schedule
        if schedule.eval_init and trainer.step == 0 and not any(r["step"] == 0 for r in self.report["evals"]):
            self.run_eval(export=False)
        steps, every, eval_every = schedule.steps, schedule.checkpoint_every, schedule.eval_every
        bar = progress_bar(schedule.progress, total=steps, initial=min(trainer.step, steps), unit="step", desc="train")
        self.window.restart()
        try:
            while trainer.step < steps:
                started = time.perf_counter()
                stats = trainer.train_step()
                trainer.seconds += time.perf_counter() - started
                self.window.add(stats)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(**self.window.postfix(), refresh=False)
                if trainer.step % every == 0 or trainer.step == steps:
                    trainer.save()
                    entry, message = self.window.checkpoint(trainer.step)
                    self.log(message)
                    self.report.setdefault("train_log", []).append(entry)
                    write_json(self.report_path, self.report)
                    self.window.restart()
                if eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
                    self.run_eval(export=True)
                    self.window.after_eval()
        finally:
            if bar is not None:
                bar.close()
        final = next((r for r in self.report["evals"] if r["step"] == trainer.step), None)
        current = self.exported_current()
        if final is None or not current:
            final = self.run_eval(export=True)
        return {"step": trainer.step, "out": str(self.out), "report": str(self.report_path), "eval": final,
                "train_log": self.report.get("train_log", [])}
