"""The capacity plan of `task=plan` from typed values: the settings, the `Hardware`, the model's shape
(its `Architecture`, a copy on the meta device, its `WeightInventory`), its compute dtype and the draft
stages of its pipeline become one JSON-ready dict (weights per precision, KV cache, tree buffers, the
devices each placement mode needs and the verify step's roofline per mode), and a cost curve measured
by `task=bench_cost` becomes the rows that check that roofline. The arithmetic is `specpipe.capacity`'s;
this module composes it per mode, apart from the task (`specpipe.tasks.plan`) that reads the config,
and from the tables people read (`specpipe.tasks.plan_render`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specpipe import capacity
from specpipe.capacity import Architecture, Fit, Hardware, StepModel

MODES = ("device map", "tensor parallel", "8-bit", "4-bit")


@dataclass(frozen=True)
class PlanSettings:
    gpus: int | None
    context_tokens: int
    headroom: float
    queries: tuple[int, ...]
    max_devices: int
    measure: bool
    out: Path | None


@dataclass(frozen=True)
class ModelShape:
    """The configured model without weights: its architecture, a copy on the meta device (what
    accelerate plans device maps on) and its parameters by kind."""

    arch: Architecture
    model: torch.nn.Module
    inv: capacity.WeightInventory

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a transformers config: the model is built on the meta device, no weights are loaded."""
        model = capacity.build_meta_model(config)
        return cls(Architecture.from_config(config), model, capacity.inventory(model))


# ---- draft stages -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftStage:
    where: str              # pipeline.drafters.eagle, pipeline.proposers.ngram, ...
    kind: str
    params: int | None      # None: not knowable from the config
    bytes: int | None       # at the target's dtype, as the stage runs
    source: str             # where the count comes from, or why there is none


def _safetensors_params(files: list[Path], skip: tuple[str, ...] = ()) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key not in skip:
                    total += math.prod(handle.get_slice(key).get_shape())
    return total


def checkpoint_params(path: Path, skip: tuple[str, ...] = ()) -> tuple[int | None, str]:
    """Parameters stored in a .safetensors file or folder (read from the headers only), else from a
    folder's config.json built on the meta device; and where the count comes from."""
    if path.is_file() and path.suffix == ".safetensors":
        return _safetensors_params([path], skip), f"{path} (tensor headers)"
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return _safetensors_params(files, skip), f"{path} (tensor headers)"
        if (path / "config.json").is_file():
            from transformers import AutoConfig

            model = capacity.build_meta_model(AutoConfig.from_pretrained(path, local_files_only=True))
            return capacity.inventory(model).total, f"{path}/config.json"
    return None, f"n/a: {path} holds no .safetensors or config.json"


# ---- devices per mode ---------------------------------------------------------------------------

def _mode_precision(mode: str, dtype: str) -> capacity.Precision:
    return capacity.precision({"8-bit": "int8", "4-bit": "int4"}.get(mode, dtype), dtype)


def fits_for(model, arch: Architecture, inv: capacity.WeightInventory, hardware: Hardware, settings: PlanSettings,
             dtype: str, shared_bytes: int, kv_total: int) -> dict[str, Fit]:
    """Each mode's fit: the fewest devices that hold the weights at the mode's precision, the KV cache
    of `kv_total` bytes and, on every device, the `shared_bytes` of tree buffers and draft."""
    usable = hardware.usable_bytes(settings.headroom)
    limit = hardware.device_limit(settings.max_devices)
    kv_per_layer = math.ceil(kv_total / arch.num_hidden_layers)
    fits = {}
    for mode in MODES:
        precision = _mode_precision(mode, dtype)
        if mode == "tensor parallel":
            ranks = capacity.valid_tensor_parallel(arch, limit)
            fits[mode] = capacity.tensor_parallel_fit(inv, precision, kv_total, shared_bytes, usable, ranks, mode)
        else:
            fits[mode] = capacity.device_map_fit(model, precision, kv_per_layer, shared_bytes, usable, limit, mode,
                                                 quantizer_max_memory(precision, dtype))
    return fits


def quantizer_max_memory(precision: capacity.Precision, dtype: str):
    """What transformers' quantizer for this precision does to max_memory before it places a
    quantized model with device_map=auto (bitsandbytes keeps 10% back); None when unquantized."""
    if precision.bits is None:
        return None
    from transformers.quantizers.auto import AutoHfQuantizer

    from specpipe.models import bitsandbytes_config, parse_dtype

    return AutoHfQuantizer.from_config(bitsandbytes_config(precision.bits, parse_dtype(dtype))).adjust_max_memory


def roofline_devices(mode: str, fit: Fit, settings: PlanSettings, valid_ranks: list[int]) -> int | None:
    """The device count a mode's roofline is computed at: the fewest it needs (a device map's step
    does not depend on the count); under tensor parallel the most valid ranks of the devices at hand."""
    if mode != "tensor parallel" or settings.gpus is None or not fit.fits:
        return fit.devices
    return max(n for n in valid_ranks if n <= max(settings.gpus, fit.devices))


def rooflines(shape: ModelShape, hardware: Hardware, settings: PlanSettings, dtype: str, fits: dict[str, Fit],
              valid_ranks: list[int]) -> dict[str, dict]:
    """Each mode that fits: the device count, the ridge point and the verify step's cost per query count."""
    result = {}
    for mode in MODES:
        fit = fits[mode]
        devices = roofline_devices(mode, fit, settings, valid_ranks)
        if devices is None or (mode == "tensor parallel" and (devices == 1 or not hardware.interconnect_gbs)):
            continue  # one rank is the device map's step; a CPU without links has no tensor parallel
        step = StepModel(shape.arch, shape.inv, _mode_precision(mode, dtype), settings.context_tokens,
                         devices if mode == "tensor parallel" else 1)
        costs = [capacity.step_cost(step, hardware, q, dtype) for q in settings.queries]
        result[mode] = {"devices": devices, "ridge_queries": capacity.ridge_queries(step, hardware, dtype),
                        "steps": [{**asdict(cost), "ms": cost.ms, "bound": cost.bound,
                                   "ratio": cost.ms / costs[0].ms} for cost in costs]}
    return result


# ---- the plan -----------------------------------------------------------------------------------

def build_plan(model_name: str, pipeline_name: str, dtype: str, settings: PlanSettings, hardware: Hardware,
               shape: ModelShape, drafts: Sequence[DraftStage]) -> dict:
    """The plan of `model_name` at the compute `dtype`, verified by pipeline `pipeline_name` whose draft
    stages are `drafts`, on devices of `hardware`."""
    dtype_bytes = capacity.DTYPE_BYTES[dtype]
    arch, inv = shape.arch, shape.inv
    buffers = capacity.tree_buffers(arch, max(settings.queries), settings.context_tokens, dtype_bytes)
    draft_bytes = sum(stage.bytes or 0 for stage in drafts)
    kv_per_token = capacity.kv_bytes_per_token(arch, dtype_bytes)
    kv_context = kv_per_token * settings.context_tokens
    # every device keeps the tree buffers and the draft whole: the draft runs beside the target's
    # first layers or on every tensor-parallel rank, and the logits are gathered where acceptance runs
    shared = buffers.total + draft_bytes
    fits = fits_for(shape.model, arch, inv, hardware, settings, dtype, shared, kv_context)
    valid_ranks = capacity.valid_tensor_parallel(arch, hardware.device_limit(settings.max_devices))
    weights = {name: {"bytes": capacity.precision(name, dtype).total_bytes(inv),
                      "scales": capacity.precision(name, dtype).scales(inv)}
               for name in ("bf16", "fp16", "fp32", "int8", "int4")}
    return {
        "model": model_name, "dtype": dtype, "hardware": asdict(hardware),
        "settings": {**asdict(settings), "out": str(settings.out) if settings.out else None},
        "architecture": asdict(arch), "parameters": asdict(inv), "weights": weights,
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_context": kv_context,
        "tree_buffers": {**asdict(buffers), "total": buffers.total},
        "draft_stages": [asdict(stage) for stage in drafts], "pipeline": pipeline_name,
        "valid_tensor_parallel": valid_ranks, "usable_bytes_per_device": hardware.usable_bytes(settings.headroom),
        "fits": {mode: {"devices": fit.devices, "per_device": list(fit.per_device), "detail": fit.detail}
                 for mode, fit in fits.items()},
        "roofline": rooflines(shape, hardware, settings, dtype, fits, valid_ranks),
    }


# ---- checked against a measured cost curve (CPU) ------------------------------------------------

def measured_check(target, kv_length: int, dtype: str, hardware: Hardware, shape: ModelShape,
                   measure: bool) -> dict:
    """The cost curve task=bench_cost stored at `kv_length` for this target runner (model, engine, dtype
    and CPU), beside the roofline at that KV length. Looked up only; `measure` measures a missing one."""
    from specpipe.cost import cached_cost_curve, cost_curve_path, read_cost_curve, streamed_weight_bytes

    path = cost_curve_path(target, kv_length)
    curve = read_cost_curve(target, kv_length, None)
    if curve is None and measure:
        curve = cached_cost_curve(target, kv_length)
    result = {"curve_file": str(path), "kv_length": kv_length, "engine": target.engine, "rows": [],
              "dtype": dtype,
              "measured": curve is not None}
    if curve is None:
        return result
    step = StepModel(shape.arch, shape.inv, capacity.precision(dtype, dtype), kv_length)
    analytic = step.weight_bytes_read()
    rows = []
    for q, ms in zip(curve.queries, curve.milliseconds):
        predicted = capacity.step_cost(step, hardware, q, dtype)
        # what this engine's weights stream for q rows (a bf16 model prepacked in fp32 on an AVX2 CPU reads fp32)
        engine_bytes = streamed_weight_bytes(target.model, rows=q)
        engine_cost = capacity.step_cost(replace(step, weights_read=engine_bytes), hardware, q, dtype)
        rows.append({"queries": q, "measured_ms": ms, "roofline_ms": predicted.ms, "engine_roofline_ms": engine_cost.ms,
                     "engine_weight_bytes": engine_bytes, "bound": predicted.bound})
    first = rows[0]
    for row in rows:
        row["measured_ratio"] = row["measured_ms"] / first["measured_ms"]
        row["roofline_ratio"] = row["roofline_ms"] / first["roofline_ms"]
        row["measured_over_roofline"] = row["measured_ms"] / row["engine_roofline_ms"]
    result.update(rows=rows, analytic_weight_bytes=analytic)
    return result
