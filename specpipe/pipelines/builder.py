"""Builds a Pipeline from a composed Hydra config: the only place, with the command line (cli.py) and the tasks,
that sees config objects."""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

import specpipe.distributed as distributed
from specpipe.cost import CostCurve, OnlineCostCurve, cached_cost_curve
from specpipe.engine.base import Engine
from specpipe.engine.hf import HFEngine
from specpipe.errors import ConfigError
from specpipe.models import LoadedModel
from specpipe.paths import CONFIG_DIR
from specpipe.pipelines.decoder import SpeculativeDecoder
from specpipe.pipelines.pipeline import Pipeline
from specpipe.pipelines.speculation_gate import SpeculationGate
from specpipe.prefix_cache import PrefixCache
from specpipe.serving.scheduler import SchedulerLimits
from specpipe.stages.base import Committer, Proposer, StepDrafter, Verifier
from specpipe.target import TargetModel
from specpipe.types import SamplingConfig

log = logging.getLogger(__name__)


def compose_config(overrides: Sequence[str] = (), config_dirs: Sequence[str | Path] = ()) -> DictConfig:
    """The config `specpipe OVERRIDES...` would see, composed from the package's `conf/` and, searched after it,
    each of `config_dirs` (folders of your own config groups: `pipeline/NAME.yaml`, `retriever/NAME.yaml`, ...)."""
    overrides = list(overrides)
    if config_dirs:
        folders = [Path(folder).expanduser().resolve() for folder in config_dirs]
        missing = [str(folder) for folder in folders if not folder.is_dir()]
        if missing:
            raise ConfigError(f"config_dirs: no such folder: {', '.join(missing)}")
        overrides.append("hydra.searchpath=[" + ",".join(f"file://{folder}" for folder in folders) + "]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except HydraException as error:
        raise ConfigError(str(error)) from None


def check_same_tokenizer(target: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, stage: str) -> None:
    """Draft tokens are verified by id, so a drafter must share the target's vocabulary exactly."""
    if len(target) != len(other) or target.get_vocab() != other.get_vocab():
        how = (f"{len(other)} tokens against the target's {len(target)}" if len(target) != len(other)
               else f"the same {len(target)} tokens, but other ids for some of them")
        raise ConfigError(
            f"stage {stage!r} uses a tokenizer that differs from the target's ({how}): its draft token ids "
            f"would mean other text. Use a drafter trained with the target's tokenizer")


def model_source(model_cfg: DictConfig):
    """The model source `cfg.model` describes (LocalModel, EmbeddedGGUFModel, ...), not loaded yet."""
    try:
        return instantiate(model_cfg, _convert_="all")  # plain dicts for device maps and quantization
    except Exception as error:  # instantiate wraps constructor errors; show the cause only
        raise ConfigError(f"cannot build model config {model_cfg.get('name')!r}: {error}") from None


def load_model(model_cfg: DictConfig) -> LoadedModel:
    return model_source(model_cfg).load()


def build_engine(cfg: DictConfig) -> Engine:
    """The forward engine `cfg.engine` names (transformers' own when the config has none)."""
    if cfg.get("engine") is None:
        return HFEngine()
    return _instantiate_stage(cfg.engine, "engine")


def build_target(cfg: DictConfig, loaded: LoadedModel) -> tuple[TargetModel, Engine]:
    """The target runner a pipeline of `cfg` verifies with: `cfg.threads`, the model rewritten by
    `cfg.engine`, `cfg.attention` (together the key its measured cost curve is cached under)."""
    threads = cfg.get("threads")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer (or null for torch's default), got {threads!r}")
        torch.set_num_threads(threads)  # before the engine: its GEMM splits follow the threads
    engine = build_engine(cfg)
    engine.apply(loaded.model, native=loaded.native)
    target = TargetModel(loaded.model, name=loaded.name, attention=str(cfg.get("attention", "auto")),
                         engine=engine.name)
    return target, engine


def build_pipeline(cfg: DictConfig, loaded: LoadedModel | None = None) -> Pipeline:
    """Instantiates every stage of `cfg.pipeline` around the target model `cfg.model`."""
    loaded = loaded or load_model(cfg.model)
    target, engine = build_target(cfg, loaded)
    return assemble_pipeline(cfg, target, loaded, engine)


def with_pipeline(cfg: DictConfig, name: str) -> DictConfig:
    """`cfg` with its `pipeline` node replaced by the one `pipeline=NAME` composes (conf/pipeline/NAME.yaml
    and its defaults): another pipeline on the same model, engine and settings."""
    overrides = [f"pipeline={name}"]
    if GlobalHydra.instance().is_initialized():  # inside run.py's app: compose from its own search path
        try:
            node = compose(config_name="config", overrides=overrides).pipeline
        except HydraException as error:
            raise ConfigError(str(error)) from None
    else:
        node = compose_config(overrides).pipeline
    other = cfg.copy()
    other.pipeline = node
    return other


def assemble_pipeline(cfg: DictConfig, target: TargetModel, loaded: LoadedModel, engine: Engine) -> Pipeline:
    """The stages of `cfg.pipeline` around a target `build_target` made: several pipelines can share one."""
    pipeline_cfg = cfg.pipeline
    proposers = [_build_source(stage_cfg, f"pipeline.proposers.{key}", target, loaded, engine)
                 for key, stage_cfg in (pipeline_cfg.get("proposers") or {}).items()]
    drafters = [_build_source(stage_cfg, f"pipeline.drafters.{key}", target, loaded, engine)
                for key, stage_cfg in (pipeline_cfg.get("drafters") or {}).items()]
    for drafter, key in zip(drafters, pipeline_cfg.get("drafters") or {}):
        if not isinstance(drafter, StepDrafter):
            raise ConfigError(f"pipeline.drafters.{key} ({type(drafter).__name__}) cannot be expanded node by node: "
                              f"put it under pipeline.proposers instead")
    tree_builder, cost_curve = None, None
    if (proposers or drafters) and pipeline_cfg.get("tree") is not None:
        make_tree = _instantiate_stage(pipeline_cfg.tree, "pipeline.tree")
        cost_curve = _cost_curve(cfg, target)
        tree_builder = _complete_stage(make_tree, "pipeline.tree", cost_curve=cost_curve)
        if cfg.get("cost_curve", "measured") != "flat":  # _cost_curve refused any other unknown choice
            for drafter in drafters:  # a draft forward is not free on a CPU: the tree builder weighs it
                runner = drafter.resources().cost_runner
                if runner is not None:
                    curve = cached_cost_curve(runner)
                    # Corrected by its levels' times where the target's curve is corrected by its steps: a cached
                    # curve keeps the moment it was measured, and a level in the pipeline reads weights a target
                    # forward evicted, so it costs more than the same level measured alone.
                    drafter.cost_curve = OnlineCostCurve(curve) if isinstance(cost_curve, OnlineCostCurve) else curve
    if drafters and tree_builder is not None:
        tree_builder.attach(drafters)
    if drafters and (tree_builder is None or not tree_builder.expands_drafters):
        raise ConfigError(f"pipeline.drafters ({', '.join(pipeline_cfg.drafters)}) are grown into a tree by a tree "
                          f"builder that expands drafters (tree=eagle2), not by {type(tree_builder).__name__}; or "
                          f"move them to pipeline.proposers to draft one chain each")
    verifier: Verifier = _instantiate_stage(cfg.verifier, "verifier")
    sampling = SamplingConfig(**OmegaConf.to_container(cfg.sampling, resolve=True))
    if not sampling.greedy and not verifier.supports_sampling:
        raise ConfigError(
            f"sampling.temperature={sampling.temperature} needs a sampling verifier; the {type(verifier).__name__} "
            f"only decodes greedily. Add verifier=rejection (the target's distribution exactly) or verifier=typical "
            f"(Medusa's typical acceptance, not lossless), or use sampling.temperature=0")
    augmenter = _instantiate_stage(pipeline_cfg.augment, "pipeline.augment") \
        if pipeline_cfg.get("augment") is not None else None
    # a batch measures whether speculating pays at its size, where trees are sized by measured costs at all
    gate = SpeculationGate() if tree_builder is not None and cfg.get("cost_curve", "measured") != "flat" else None
    # and, where drafters grow trees beside proposers, whether growing the drafters pays at its size
    draft_gate = SpeculationGate() if gate is not None and drafters and proposers else None
    if cfg.get("commit") is None:
        raise ConfigError("commit= names the Commit stage (conf/commit/: commit=kv_compact); this config has none")
    committer: Committer = _instantiate_stage(cfg.commit, "commit")
    decoder = SpeculativeDecoder(target, proposers, tree_builder, verifier, committer, drafters=drafters,
                                 forward_costs=cost_curve if isinstance(cost_curve, OnlineCostCurve) else None,
                                 gate=gate, prefix_cache=prefix_cache(cfg, target), draft_gate=draft_gate)
    limits = scheduler_limits(cfg)
    return Pipeline(str(pipeline_cfg.name), decoder, loaded.tokenizer, chat_template=bool(cfg.chat_template),
                    system_prompt=cfg.get("system_prompt"), sampling=sampling, augmenter=augmenter, limits=limits)


# prefix_cache.memory_mb=auto: on for the tasks that serve many requests over time (the same system prompt, RAG
# template or question comes again), off where every prompt is new and a row-invariant prefill only costs
SERVING_TASKS = {"serve": 1024}


def prefix_cache(cfg: DictConfig, target: TargetModel) -> PrefixCache | None:
    """The prefix cache `cfg.prefix_cache` asks for, where `target`'s engine can make it exact; else None."""
    node = cfg.get("prefix_cache")
    if node is None:
        return None
    values = OmegaConf.to_container(node, resolve=True)
    unknown = sorted(set(values) - {"memory_mb", "block_tokens", "chunk_tokens"})
    if unknown:
        raise ConfigError(f"prefix_cache has no setting {', '.join(unknown)}; known: block_tokens, chunk_tokens, "
                          f"memory_mb")
    memory_mb = values.get("memory_mb", "auto")
    if memory_mb == "auto":
        task = cfg.get("task")
        memory_mb = SERVING_TASKS.get(task.get("name") if task is not None else None, 0)
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 0:
        raise ConfigError(f"prefix_cache.memory_mb must be a number of MiB >= 0 (0 = off) or auto, got {memory_mb!r}")
    if memory_mb == 0:
        return None
    sizes = {name: values[name] for name in ("block_tokens", "chunk_tokens") if name in values}
    cache = PrefixCache(memory_mb << 20, **sizes)
    if not target.row_invariant:
        log.warning("prefix_cache: off, engine=%s does not compute a prefill's rows independently of the rows "
                    "beside them (the CPU engine with engine.batch_invariant=true does), so reused rows would not "
                    "be a fresh prefill's", target.engine)
        return None
    log.info("prefix_cache: prompt prefixes kept in blocks of %d tokens, up to %d MiB; prefills row-invariant in "
             "chunks of %d rows", cache.block_tokens, memory_mb, cache.chunk_tokens)
    return cache


def scheduler_limits(cfg: DictConfig) -> SchedulerLimits:
    """The batch engine's limits of `cfg.scheduler` (the defaults where it has none)."""
    node = cfg.get("scheduler")
    if node is None:
        return SchedulerLimits()
    values = OmegaConf.to_container(node, resolve=True)
    known = {field.name for field in dataclasses.fields(SchedulerLimits)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"scheduler has no setting {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return SchedulerLimits(**values)


def _build_source(stage_cfg: DictConfig, where: str, target: TargetModel, loaded: LoadedModel,
                  engine: Engine) -> Proposer:
    """A Retrieve/Draft stage; a `_partial_` one gets the target and tokenizer, and a stage with a
    model of its own (`draft`) runs it under the target's engine."""
    stage = _instantiate_stage(stage_cfg, where)
    if isinstance(stage, functools.partial):  # _partial_: needs the target at run time
        stage = _complete_stage(stage, where, target=target, tokenizer=loaded.tokenizer)
    if not isinstance(stage, Proposer):
        raise ConfigError(f"{where} ({type(stage).__name__}) is not a Retrieve/Draft stage: it must implement "
                          f"specpipe.stages.base.Proposer")
    resources = stage.resources()
    if resources.tokenizer is not None and resources.tokenizer is not loaded.tokenizer:
        check_same_tokenizer(loaded.tokenizer, resources.tokenizer, where)
    quantize = resources.weight_quantization  # a drafter's own weights in int8 (engine.quantize)
    if resources.draft_model is not None:
        engine.apply(resources.draft_model, quantize=quantize, drafter=True)
    # Weights a stage runs outside its draft model (an EAGLE head's reduced output layer, Medusa's heads):
    # unpacked, a few-row fp32 product of an 8192-row output layer costs ~6x the packed one.
    for module in resources.engine_modules:
        engine.apply(module, quantize=quantize)
    return stage


def _cost_curve(cfg: DictConfig, target: TargetModel) -> CostCurve | OnlineCostCurve:
    choice = cfg.get("cost_curve", "measured")
    if choice == "flat":
        return CostCurve.flat()
    if choice == "measured":
        return cached_cost_curve(target)
    if choice == "online":
        curve = cached_cost_curve(target)
        # Times taken on the host would miss a GPU's queued work; tensor-parallel ranks must size
        # their trees alike, which their own timings would not: both keep the measured curve.
        if target.device.type != "cpu" or distributed.active():
            log.info("cost_curve=online corrects the curve on one CPU process only: using the measured curve")
            return curve
        return OnlineCostCurve(curve)
    raise ConfigError(f"cost_curve must be 'measured', 'online' or 'flat', got {choice!r}")


def _complete_stage(partial, where: str, **arguments):
    """A `_partial_` stage called with what the builder adds; a config key the stage does not take, or a
    value it refuses as a plain TypeError/ValueError, is a ConfigError naming the config node."""
    try:
        return partial(**arguments)
    except (TypeError, ValueError) as error:
        target = getattr(getattr(partial, "func", partial), "__qualname__", "?")
        raise ConfigError(f"cannot build {where} ({target}): {error}") from None


def _instantiate_stage(stage_cfg: DictConfig, where: str):
    try:
        return instantiate(stage_cfg)
    except Exception as error:
        raise ConfigError(f"cannot build {where} ({stage_cfg.get('_target_')}): {error}") from None
