"""The settings of `task=bench` read from the composed config and checked before any model loads, so a typo
stops the run at once with the key it concerns. Also the pieces the benchmark tasks share: the settings group
whose `dtype` sets the model's (`benchmark_settings`), the folder reports go to (`output_dir`), and the command
line a report records (`hydra_job_info`).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import specpipe.distributed as distributed
from specpipe.errors import ConfigError, InvalidRequest
from specpipe.models import parse_dtype
from specpipe.tasks.bench_questions import DEFAULT_GROUPS, resolve_prompts_path


@dataclass(frozen=True)
class BenchSettings:
    """`cfg.bench`, checked (`read_settings`)."""

    prompts: Path
    per_category: int
    max_new_tokens: int
    dtype: str
    methods: tuple[str, ...]
    compare: tuple[str, ...]  # further pipelines (conf/pipeline/ names) run as methods of their own
    warmup: int
    pld_tokens: int
    categories: tuple[str, ...] | None
    group_categories: dict[str, str]  # category -> the category it is reported under
    out: Path
    time_limit_s: float | None = None  # stop before a question that would end past it (warm-up included)
    relative_to: str | None = None  # a method the report gives every other's speed over, with an interval
    llama_cpp_url: str | None = None  # the llama-server of method llama_cpp


def benchmark_settings(cfg: DictConfig, key: str, benchmark: str) -> DictConfig:
    """`cfg[key]`, the settings of `task=KEY`, once `model.dtype` is the one they set: conf/task/KEY.yaml
    interpolates `model.dtype: ${KEY.dtype}`, so a `model.dtype=` override would leave the report naming another
    dtype than the model ran. `benchmark` names the task in the error."""
    settings = cfg.get(key)
    if settings is None:
        raise ConfigError(f"task={key} needs the `{key}` settings of conf/task/{key}.yaml; run with task={key}")
    if parse_dtype(cfg.model.dtype) != parse_dtype(settings.dtype):
        raise ConfigError(f"{benchmark} sets the model dtype from {key}.dtype ({settings.dtype}), but model.dtype "
                          f"was set to {cfg.model.dtype}; use {key}.dtype={cfg.model.dtype} instead")
    return settings


def read_settings(cfg: DictConfig) -> BenchSettings:
    """`cfg.bench` checked; a bad value stops with the key it concerns."""
    bench = benchmark_settings(cfg, "bench", "the benchmark")
    max_new_tokens = bench.max_new_tokens
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise InvalidRequest(f"bench.max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    warmup = int(bench.get("warmup") or 0)
    if warmup < 0:
        raise InvalidRequest(f"bench.warmup must be >= 0, got {warmup}")
    categories = bench.get("categories")
    if isinstance(categories, str):
        categories = [categories]
    time_limit_s = bench.get("time_limit_s")
    if time_limit_s is not None:
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
            raise InvalidRequest(f"bench.time_limit_s must be a positive number of seconds or null, got "
                                 f"{time_limit_s!r}")
        if distributed.active():  # each rank would judge the time by its own clock and stop at another question
            raise ConfigError("bench.time_limit_s is not supported with tensor parallel ranks: leave it null")
    return BenchSettings(
        prompts=resolve_prompts_path(str(bench.prompts)),
        group_categories=read_groups(bench.get("group_categories", DEFAULT_GROUPS)),
        per_category=bench.per_category,
        max_new_tokens=max_new_tokens,
        dtype=str(bench.dtype),
        methods=tuple(bench.get("methods") or ()),
        compare=read_compare(bench.get("compare")),
        warmup=warmup,
        pld_tokens=int(bench.get("pld_tokens") or 10),
        categories=tuple(categories) if categories else None,
        out=output_dir(bench.get("out")),
        time_limit_s=float(time_limit_s) if time_limit_s is not None else None,
        relative_to=read_relative_to(bench.get("relative_to")),
        llama_cpp_url=bench.get("llama_cpp_url"),
    )


def read_relative_to(name: object) -> str | None:
    """bench.relative_to: one method name, or null."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"bench.relative_to must name one method of this run (e.g. vanilla, or a pipeline of "
                             f"bench.compare), or be null; got {name!r}")
    return name


def read_compare(compare: object) -> tuple[str, ...]:
    """bench.compare: a list of conf/pipeline/ names (one name alone is taken as a list of one)."""
    if compare is None:
        return ()
    if isinstance(compare, str):
        compare = [compare]
    names = list(compare) if not isinstance(compare, (Mapping, DictConfig)) else None
    if names is None or not all(isinstance(name, str) and name for name in names):
        raise InvalidRequest(f"bench.compare must list pipelines of conf/pipeline/, e.g. [prompt_lookup,lookahead_trie]; "
                             f"got {compare!r}")
    return tuple(names)


def read_groups(groups: object) -> dict[str, str]:
    """bench.group_categories: {category: reported category}; null reports every category alone. By default
    Spec-Bench's eight MT-bench categories are reported as one, `mt_bench`; bench.per_category still counts
    questions per original category."""
    if groups is None:
        return {}
    if isinstance(groups, DictConfig):
        groups = OmegaConf.to_container(groups, resolve=True)
    if not isinstance(groups, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                  for k, v in groups.items()):
        raise InvalidRequest(f"bench.group_categories must map categories to the category they are reported "
                             f"under, e.g. {{writing: mt_bench}}; got {groups!r}")
    return dict(groups)


def output_dir(out: str | None, key: str = "bench.out") -> Path:
    """`out` (the config's `key`), or the Hydra run dir; in a multirun every job writes into its own job dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN and out:
        raise ConfigError("in a multirun (-m) every job writes into its own Hydra job dir and the sweep merges "
                          f"them: leave {key} unset and choose the place with hydra.sweep.dir=DIR")
    if out:
        return Path(str(out)).expanduser()
    if hydra_cfg is None:
        raise ConfigError(f"{key} is not set and there is no Hydra run dir to default to; give {key}=DIR")
    return Path(hydra_cfg.runtime.output_dir)


def hydra_job_info() -> dict:
    """The command line and overrides of the current Hydra job (empty outside `run.py`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"command": " ".join(sys.argv), "overrides": [], "job_num": None}
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    job_num = hydra_cfg.job.get("num") if hydra_cfg.mode.name == "MULTIRUN" else None
    return {"command": "python run.py " + " ".join(overrides), "overrides": overrides, "job_num": job_num}
