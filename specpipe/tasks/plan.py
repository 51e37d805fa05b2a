"""`task=plan`: a capacity plan for the configured model on a kind of hardware. The task reads the config
(the plan's settings, the hardware, the model's architecture from `model.path`'s config.json, the
embedded model's converted folder, tiny_random's fields or a model config's `architecture:` mapping, and
the checkpoints of the pipeline's draft stages), has `specpipe.tasks.plan_build` compute the plan from
those typed values, prints it as markdown (`specpipe.tasks.plan_render`) and writes plan.json and
plan.md into `plan.out` when given. On a CPU hardware config the cost curve `task=bench_cost` measured
for this model is looked up and printed beside the roofline; it, and this CPU's bandwidth and matmul
peak, are measured here only with plan.measure=true.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specpipe import capacity
from specpipe.capacity import Hardware
from specpipe.errors import ConfigError, InvalidRequest
from specpipe.tasks.plan_build import (DraftStage, ModelShape, PlanSettings, build_plan, checkpoint_params,
                                       measured_check)
from specpipe.tasks.plan_render import check_markdown, markdown, measured_hardware_markdown

DEFAULT_HARDWARE = "cpu_epyc_2core"  # task=plan without hardware=: the machine it runs on


def read_settings(cfg: DictConfig) -> PlanSettings:
    plan = cfg.plan
    queries = tuple(int(q) for q in plan.queries)
    if not queries or min(queries) < 1 or list(queries) != sorted(set(queries)):
        raise InvalidRequest(f"plan.queries must be increasing positive counts, got {list(queries)}")
    gpus = plan.get("gpus")
    if gpus is not None and int(gpus) < 1:
        raise InvalidRequest(f"plan.gpus must be a positive count (or null), got {gpus}")
    if int(plan.context_tokens) < 0:
        raise InvalidRequest(f"plan.context_tokens must be >= 0, got {plan.context_tokens}")
    if not 0 <= float(plan.headroom) < 1:
        raise InvalidRequest(f"plan.headroom is a fraction of each device's memory in [0, 1), got {plan.headroom}")
    if int(plan.max_devices) < 1:
        raise InvalidRequest(f"plan.max_devices must be >= 1, got {plan.max_devices}")
    out = plan.get("out")
    return PlanSettings(None if gpus is None else int(gpus), int(plan.context_tokens), float(plan.headroom), queries,
                        int(plan.max_devices), bool(plan.get("measure", False)),
                        Path(str(out)).expanduser() if out else None)


def load_hardware(cfg: DictConfig) -> Hardware:
    from specpipe.paths import CONFIG_DIR

    node = cfg.get("hardware")
    if node is None:
        node = OmegaConf.load(CONFIG_DIR / "hardware" / f"{DEFAULT_HARDWARE}.yaml")
    fields = OmegaConf.to_container(node, resolve=True)
    try:
        return Hardware(name=str(fields["name"]), description=str(fields.get("description", fields["name"])),
                        kind=str(fields["kind"]), memory_gib=float(fields["memory_gib"]),
                        bandwidth_gbs=float(fields["bandwidth_gbs"]),
                        tflops={str(k): float(v) for k, v in fields["tflops"].items()},
                        interconnect_gbs=_optional(fields.get("interconnect_gbs"), float),
                        max_devices=_optional(fields.get("max_devices"), int))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f"hardware config {fields.get('name')!r} is incomplete or wrong ({type(error).__name__}: "
                          f"{error}); it needs name, kind, memory_gib, bandwidth_gbs, tflops") from None


def _optional(value, kind):
    return None if value is None else kind(value)


def model_config(model_cfg: DictConfig):
    """The transformers config of `cfg.model`, without loading any weights (each model source knows
    where its shape lives: model.path, the converted embedded model, tiny_random's fields, or a
    model config's `architecture:` mapping)."""
    from specpipe.pipelines.builder import model_source

    return model_source(model_cfg).hf_config()


def compute_dtype(model_cfg: DictConfig) -> str:
    from specpipe.engine.cpu import DTYPE_NAMES
    from specpipe.models import parse_dtype

    return DTYPE_NAMES[parse_dtype(model_cfg.get("dtype", "fp32"))]


def plan_target(cfg: DictConfig):
    """The target runner a pipeline of this config verifies with (model, engine, attention, threads):
    the key under which task=bench_cost stored its cost curve."""
    from specpipe.pipelines.builder import build_target, load_model

    return build_target(cfg, load_model(cfg.model))[0]


# ---- draft stages -------------------------------------------------------------------------------

def _default_checkpoint(target: str, stage_cfg: DictConfig) -> Path | None:
    """The checkpoint a draft stage loads for the embedded model when it is given no path."""
    from specpipe.paths import PACKAGE_ROOT

    if target.endswith("draft_model.load_drafter"):
        from specpipe.distill.draft_model import DEFAULT_DRAFT_PATH

        return Path(DEFAULT_DRAFT_PATH)
    if target.endswith("eagle.load_eagle"):
        from specpipe.stages.draft.eagle_checkpoint import DEFAULT_EAGLE_DIR

        return PACKAGE_ROOT / DEFAULT_EAGLE_DIR
    if target.endswith("eagle3.load_eagle3"):
        from specpipe.stages.draft.eagle3 import DEFAULT_EAGLE3_DIR

        return PACKAGE_ROOT / DEFAULT_EAGLE3_DIR
    if target.endswith("medusa.load_medusa"):
        from specpipe.stages.draft.medusa import DEFAULT_HYDRA_DIR, DEFAULT_MEDUSA_DIR

        return PACKAGE_ROOT / (DEFAULT_HYDRA_DIR if stage_cfg.get("hydra") else DEFAULT_MEDUSA_DIR)
    return None


def _skipped_keys(target: str) -> tuple[str, ...]:
    """Checkpoint keys a head loader leaves to the base model (released EAGLE heads carry its embedding)."""
    if target.endswith("eagle.load_eagle"):
        from specpipe.stages.draft.eagle_checkpoint import BASE_MODEL_KEYS

        return BASE_MODEL_KEYS
    if target.endswith("eagle3.load_eagle3"):
        from specpipe.stages.draft.eagle3 import UNUSED_KEYS

        return UNUSED_KEYS
    return ()


def draft_stages(cfg: DictConfig, dtype_bytes: int) -> list[DraftStage]:
    """Each Retrieve/Draft stage of the pipeline with the parameters it adds to the target's."""
    pipeline = cfg.get("pipeline") or {}
    embedded = str(cfg.model.get("_target_", "")).endswith("EmbeddedGGUFModel") and not cfg.model.get("path")
    stages = []
    for group in ("drafters", "proposers"):
        for key, stage_cfg in (pipeline.get(group) or {}).items():
            where, target = f"pipeline.{group}.{key}", str(stage_cfg.get("_target_", ""))
            kind = str(stage_cfg.get("name", key))
            if target.endswith("layer_skip.load_layer_skip"):
                stages.append(DraftStage(where, kind, 0, 0, "none: drafts with the target's own layers"))
            elif target.endswith("jacobi.JacobiDrafter"):
                rows = int(stage_cfg.window) * (int(stage_cfg.ngram) - 1) - 1
                stages.append(DraftStage(where, kind, 0, 0, f"none: the target itself; its window adds {rows} "
                                                            f"query rows to every verify"))
            elif "stages.retrieve" in target:
                stages.append(DraftStage(where, kind, 0, 0, "none: n-grams / a datastore on disk, no model"))
            elif "path" in stage_cfg:
                path = stage_cfg.get("path")
                default = _default_checkpoint(target, stage_cfg)
                if path:
                    params, source = checkpoint_params(Path(str(path)).expanduser(), _skipped_keys(target))
                elif default is not None and embedded:
                    params, source = checkpoint_params(default, _skipped_keys(target))
                else:
                    params, source = None, ("n/a: no drafter.path given (the default checkpoint is the embedded "
                                            "model's)")
                stages.append(DraftStage(where, kind, params, None if params is None else params * dtype_bytes,
                                         source))
            else:
                stages.append(DraftStage(where, kind, None, None, f"n/a: {target or 'unknown stage'}"))
    return stages


# ---- measured on this CPU (plan.measure=true) ----------------------------------------------------

def measure_matmul_tflops(size: int = 2048, rounds: int = 7) -> float:
    """The fp32 matmul peak this CPU reaches: the faster of torch.mm (its BLAS) and oneDNN's
    prepacked kernel (engine=fast's path for verify-sized products) on a square `size` product,
    each the median of rounds after a warm-up."""
    from specpipe.engine.cpu import onednn_available, pack_weight, packed_linear

    weight, x = torch.randn(size, size), torch.randn(size, size)
    weight_t = weight.t().contiguous()
    runs = [lambda: x @ weight_t]
    if onednn_available():
        packed = pack_weight(weight)
        runs.append(lambda: packed_linear(x, packed, None))
    best = 0.0
    for run in runs:
        run()
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        best = max(best, 2 * size ** 3 / statistics.median(samples) / 1e12)
    return best


def measure_hardware() -> dict:
    """This CPU's read bandwidth (the project's own `measure_read_bandwidth`) and fp32 matmul peak."""
    from specpipe.cost import measure_read_bandwidth

    return {"threads": torch.get_num_threads(), "read_bandwidth_gbs": measure_read_bandwidth(),
            "fp32_matmul_tflops": measure_matmul_tflops()}


# ---- the task -----------------------------------------------------------------------------------

def run_plan(cfg: DictConfig) -> dict:
    """The plan of the configured model: printed as markdown, written into plan.out when given, returned."""
    settings = read_settings(cfg)
    hardware = load_hardware(cfg)
    shape = ModelShape.of(model_config(cfg.model))
    dtype = compute_dtype(cfg.model)
    drafts = draft_stages(cfg, capacity.DTYPE_BYTES[dtype])
    plan = build_plan(str(cfg.model.name), str(cfg.pipeline.name), dtype, settings, hardware, shape, drafts)
    text = markdown(plan)
    # task=bench_cost measures its cost curves on a CPU, with the model whole in its memory
    if hardware.kind == "cpu" and plan["fits"]["device map"]["devices"] is not None:
        from specpipe.tasks.bench_cost import POLICY_KV_LENGTH

        check = measured_check(plan_target(cfg), POLICY_KV_LENGTH, dtype, hardware, shape, settings.measure)
        plan["measured_check"] = check
        text += "\n" + check_markdown(check, hardware)
    if settings.measure and hardware.kind == "cpu":
        measured = measure_hardware()
        plan["measured_hardware"] = measured
        text += measured_hardware_markdown(measured, hardware)
    print(text)
    if settings.out is not None:
        from specpipe.tasks.bench_report import write_text

        settings.out.mkdir(parents=True, exist_ok=True)
        write_text(settings.out / "plan.json", json.dumps(plan, indent=1))
        write_text(settings.out / "plan.md", text)
        print(f"plan: written to {settings.out}", file=sys.stderr)
    return plan
