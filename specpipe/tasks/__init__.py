"""What `run.py` dispatches to: `task=NAME` runs `TASKS[NAME]` with the composed config.

Each task lives in its own module, imported only when chosen (bench pulls in pandas and
matplotlib; a store build pulls in FAISS).
"""
from __future__ import annotations

import importlib

from omegaconf import DictConfig

from specpipe.errors import ConfigError

# task name -> (module, function); the function takes the composed config.
TASKS: dict[str, tuple[str, str]] = {
    "generate": ("specpipe.tasks.generate", "run_generate"),
    "bench": ("specpipe.tasks.bench", "run_bench"),
    "bench_cost": ("specpipe.tasks.bench_cost", "run_bench_cost"),
    "build_store": ("specpipe.tasks.build_store", "run_build_store"),
    "distill_corpus": ("specpipe.tasks.distill_corpus", "run_distill_corpus"),
    "distill_draft": ("specpipe.tasks.distill_draft", "run_distill_draft"),
    "search_layers": ("specpipe.tasks.search_layers", "run_search_layers"),
}


def run_task(cfg: DictConfig) -> None:
    name = cfg.task.name
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose task={' | '.join(sorted(TASKS))}")
    module, function = TASKS[name]
    getattr(importlib.import_module(module), function)(cfg)
