"""What `run.py` dispatches to: `task=NAME` runs `TASKS[NAME]` with the composed config.

Each task lives in its own module, imported only when chosen (bench pulls in pandas and
matplotlib; a store build pulls in FAISS).
"""
from __future__ import annotations

import importlib
import shlex

from omegaconf import DictConfig

from specpipe import distributed
from specpipe.errors import ConfigError

# task name -> (module, function); the function takes the composed config.
TASKS: dict[str, tuple[str, str]] = {
    "generate": ("specpipe.tasks.generate", "run_generate"),
    "bench": ("specpipe.tasks.bench", "run_bench"),
    "bench_load": ("specpipe.tasks.bench_load", "run_bench_load"),
    "bench_cost": ("specpipe.tasks.bench_cost", "run_bench_cost"),
    "build_store": ("specpipe.tasks.build_store", "run_build_store"),
    "distill_corpus": ("specpipe.tasks.distill_corpus", "run_distill_corpus"),
    "distill_draft": ("specpipe.tasks.distill_draft", "run_distill_draft"),
    "search_layers": ("specpipe.tasks.search_layers", "run_search_layers"),
    "train_heads": ("specpipe.tasks.train_heads", "run_train_heads"),
    "calibrate_tree": ("specpipe.tasks.calibrate_tree", "run_calibrate_tree"),
    "plan": ("specpipe.tasks.plan", "run_plan"),
    "serve": ("specpipe.tasks.serve", "run_serve"),
}



def hydra_overrides() -> list[str]:
    """The command-line overrides of this run (none when called outside `run.py`)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def task_command(task: str) -> str:
    """The command that reproduces this run of `task=NAME`, for the sidecars a task writes."""
    overrides = [o for o in hydra_overrides() if o != f"task={task}"]
    return " ".join([f"python run.py task={task}", *(shlex.quote(o) for o in overrides)])


def run_task(cfg: DictConfig) -> None:
    name = cfg.task.name
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose task={' | '.join(sorted(TASKS))}")
    module, function = TASKS[name]
    with distributed.output_on_main_only():
        getattr(importlib.import_module(module), function)(cfg)
