"""`task=plan`: a capacity plan for the configured model on a kind of hardware.

Prints (and writes as plan.json into `plan.out` when given) the weights' memory per precision, the
KV cache per 1K tokens, the draft stages' parameters, the verify forward's tree buffers, how many
devices the model needs under a device map, tensor parallel, 8-bit and 4-bit, and the roofline
time of one verify step against the number of query tokens (specpipe.capacity does the
arithmetic). On a CPU hardware config the cost curve `task=bench_cost` measured for this model is
looked up and printed beside the prediction; it is measured here only with plan.measure=true.

The architecture comes from `model.path`'s config.json, the embedded model's converted folder,
tiny_random's fields, or a model config's `architecture:` mapping (the public config.json fields).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specpipe import capacity
from specpipe.capacity import GIB, Architecture, Fit, Hardware, StepModel
from specpipe.errors import ConfigError, InvalidRequest

DEFAULT_HARDWARE = "cpu_epyc_2core"  # task=plan without hardware=: the machine it runs on
MODES = ("device map", "tensor parallel", "8-bit", "4-bit")
# How each mode is asked for in this project's placement options (conf/placement/defaults.yaml).
MODE_SETTINGS = {"device map": "model.device_map=auto",
                 "tensor parallel": "torchrun --nproc-per-node N ... model.tp_plan=auto",
                 "8-bit": "model.quantization=8bit model.device_map=auto",
                 "4-bit": "model.quantization=4bit model.device_map=auto"}


@dataclass(frozen=True)
class PlanSettings:
    gpus: int | None
    context_tokens: int
    headroom: float
    queries: tuple[int, ...]
    max_devices: int
    measure: bool
    out: Path | None


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


def _checkpoint_params(path: Path, skip: tuple[str, ...] = ()) -> tuple[int | None, str]:
    """Parameters stored in a .safetensors file or folder (read from the headers only), else from a
    folder's config.json built on the meta device."""
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
                    params, source = _checkpoint_params(Path(str(path)).expanduser(), _skipped_keys(target))
                elif default is not None and embedded:
                    params, source = _checkpoint_params(default, _skipped_keys(target))
                else:
                    params, source = None, ("n/a: no drafter.path given (the default checkpoint is the embedded "
                                            "model's)")
                stages.append(DraftStage(where, kind, params, None if params is None else params * dtype_bytes,
                                         source))
            else:
                stages.append(DraftStage(where, kind, None, None, f"n/a: {target or 'unknown stage'}"))
    return stages


# ---- the plan -----------------------------------------------------------------------------------

def _mode_precision(mode: str, dtype: str) -> capacity.Precision:
    return capacity.precision({"8-bit": "int8", "4-bit": "int4"}.get(mode, dtype), dtype)


def fits_for(model, arch: Architecture, inv: capacity.WeightInventory, hardware: Hardware, settings: PlanSettings,
             dtype: str, shared_bytes: int) -> dict[str, Fit]:
    usable = hardware.usable_bytes(settings.headroom)
    limit = min(settings.max_devices, hardware.max_devices or settings.max_devices)
    kv_total = capacity.kv_bytes_per_token(arch, capacity.DTYPE_BYTES[dtype]) * settings.context_tokens
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


@dataclass(frozen=True)
class ModelShape:
    """The configured model without weights: its architecture, a copy on the meta device (what
    accelerate plans device maps on) and its parameters by kind."""

    arch: Architecture
    model: torch.nn.Module
    inv: capacity.WeightInventory


def model_shape(model_cfg: DictConfig) -> ModelShape:
    config = model_config(model_cfg)
    model = capacity.build_meta_model(config)
    return ModelShape(Architecture.from_config(config), model, capacity.inventory(model))


def build_plan(cfg: DictConfig, settings: PlanSettings, hardware: Hardware, shape: ModelShape) -> dict:
    dtype = compute_dtype(cfg.model)
    dtype_bytes = capacity.DTYPE_BYTES[dtype]
    arch, model, inv = shape.arch, shape.model, shape.inv
    tree_tokens = max(settings.queries)
    buffers = capacity.tree_buffers(arch, tree_tokens, settings.context_tokens, dtype_bytes)
    drafts = draft_stages(cfg, dtype_bytes)
    draft_bytes = sum(stage.bytes or 0 for stage in drafts)
    # every device keeps the tree buffers and the draft whole: the draft runs beside the target's
    # first layers or on every tensor-parallel rank, and the logits are gathered where acceptance runs
    shared = buffers.total + draft_bytes
    fits = fits_for(model, arch, inv, hardware, settings, dtype, shared)
    limit = min(settings.max_devices, hardware.max_devices or settings.max_devices)
    valid_ranks = capacity.valid_tensor_parallel(arch, limit)
    weights = {name: {"bytes": capacity.precision(name, dtype).total_bytes(inv),
                      "scales": capacity.precision(name, dtype).scales(inv)}
               for name in ("bf16", "fp16", "fp32", "int8", "int4")}
    rooflines = {}
    for mode in MODES:
        fit = fits[mode]
        devices = roofline_devices(mode, fit, settings, valid_ranks)
        if devices is None or (mode == "tensor parallel" and (devices == 1 or not hardware.interconnect_gbs)):
            continue  # one rank is the device map's step; a CPU without links has no tensor parallel
        step = StepModel(arch, inv, _mode_precision(mode, dtype), settings.context_tokens,
                         devices if mode == "tensor parallel" else 1)
        costs = [capacity.step_cost(step, hardware, q, dtype) for q in settings.queries]
        rooflines[mode] = {"devices": devices, "ridge_queries": capacity.ridge_queries(step, hardware, dtype),
                           "steps": [{**asdict(cost), "ms": cost.ms, "bound": cost.bound,
                                      "ratio": cost.ms / costs[0].ms} for cost in costs]}
    return {
        "model": str(cfg.model.name), "dtype": dtype, "hardware": asdict(hardware),
        "settings": {**asdict(settings), "out": str(settings.out) if settings.out else None},
        "architecture": asdict(arch), "parameters": asdict(inv), "weights": weights,
        "kv_bytes_per_token": capacity.kv_bytes_per_token(arch, dtype_bytes),
        "kv_bytes_context": capacity.kv_bytes_per_token(arch, dtype_bytes) * settings.context_tokens,
        "tree_buffers": {**asdict(buffers), "total": buffers.total},
        "draft_stages": [asdict(stage) for stage in drafts], "pipeline": str(cfg.pipeline.name),
        "valid_tensor_parallel": valid_ranks, "usable_bytes_per_device": hardware.usable_bytes(settings.headroom),
        "fits": {mode: {"devices": fit.devices, "per_device": list(fit.per_device), "detail": fit.detail}
                 for mode, fit in fits.items()},
        "roofline": rooflines,
    }


# ---- checked against a measured cost curve (CPU) ------------------------------------------------

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


def plan_target(cfg: DictConfig):
    """The target runner a pipeline of this config verifies with (model, engine, attention, threads):
    the key under which task=bench_cost stored its cost curve."""
    from specpipe.pipelines.builder import build_target, load_model

    return build_target(cfg, load_model(cfg.model))[0]


def measured_check(cfg: DictConfig, plan: dict, settings: PlanSettings, hardware: Hardware,
                   shape: ModelShape) -> dict | None:
    """The cost curve task=bench_cost stored for this model, engine, dtype and CPU, beside the
    roofline at the KV length it was measured at. Looked up only (plan.measure=true measures a
    missing one); None when the hardware is not a CPU or the model does not fit in its memory."""
    from specpipe.cost import read_cost_curve, cached_cost_curve, cost_curve_path, streamed_weight_bytes
    from specpipe.tasks.bench_cost import POLICY_KV_LENGTH

    if hardware.kind != "cpu" or plan["fits"]["device map"]["devices"] is None:
        return None
    target = plan_target(cfg)
    path = cost_curve_path(target, POLICY_KV_LENGTH)
    curve = read_cost_curve(target, POLICY_KV_LENGTH, None)
    if curve is None and settings.measure:
        curve = cached_cost_curve(target, POLICY_KV_LENGTH)
    result = {"curve_file": str(path), "kv_length": POLICY_KV_LENGTH, "engine": target.engine, "rows": [],
              "dtype": plan["dtype"],
              "measured": curve is not None}
    if curve is None:
        return result
    dtype = plan["dtype"]
    step = StepModel(shape.arch, shape.inv, capacity.precision(dtype, dtype), POLICY_KV_LENGTH)
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


def measure_hardware() -> dict:
    """This CPU's read bandwidth (the project's own `measure_read_bandwidth`) and fp32 matmul peak."""
    from specpipe.cost import measure_read_bandwidth

    return {"threads": torch.get_num_threads(), "read_bandwidth_gbs": measure_read_bandwidth(),
            "fp32_matmul_tflops": measure_matmul_tflops()}


# ---- printing -----------------------------------------------------------------------------------

def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:,.2f}"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f}"


def markdown(plan: dict) -> str:
    hw, settings, inv, arch = plan["hardware"], plan["settings"], plan["parameters"], plan["architecture"]
    dtype = plan["dtype"]
    at_hand = f", {settings['gpus']} at hand" if settings["gpus"] else ""
    lines = [f"## Capacity plan: {plan['model']} ({dtype}) on {hw['description']}{at_hand}", "",
             f"{hw['memory_gib']:g} GiB, {hw['bandwidth_gbs']:g} GB/s, {hw['tflops'].get(dtype, float('nan')):g} "
             f"TFLOPS {dtype} per device"
             + (f", links {hw['interconnect_gbs']:g} GB/s" if hw["interconnect_gbs"] else "")
             + f"; headroom {settings['headroom']:.0%} (usable {_gib(plan['usable_bytes_per_device'])} GiB per "
             f"device), "
             f"KV budget {settings['context_tokens']:,} tokens x batch 1, pipeline {plan['pipeline']}.", "",
             f"{inv['total']:,} parameters: {arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, MLP "
             f"{arch['intermediate_size']}, {arch['num_attention_heads']} heads / {arch['num_key_value_heads']} KV "
             f"heads "
             f"x {arch['head_dim']}, vocabulary {arch['vocab_size']:,}, embeddings "
             f"{'tied' if arch['tie_word_embeddings'] else 'untied'}.", "",
             "### Memory", "", "| what | bytes | GiB |", "|---|---:|---:|"]
    kept = f"embeddings, output layer, norms {dtype}"
    for name, label in (("bf16", "weights bf16 / fp16"), ("fp32", "weights fp32"),
                        ("int8", f"weights 8-bit (linears int8 + fp32 row scales; {kept})"),
                        ("int4", f"weights 4-bit (linears 4-bit + fp32 absmax per 64; {kept})")):
        value = plan["weights"][name]["bytes"]
        lines.append(f"| {label} | {value:,} | {_gib(value)} |")
    kv_token = plan["kv_bytes_per_token"]
    lines.append(f"| KV cache per 1,024 tokens ({dtype}: 2 x {arch['num_hidden_layers']} layers x "
                 f"{arch['num_key_value_heads']} KV heads x {arch['head_dim']} x {capacity.DTYPE_BYTES[dtype]} B "
                 f"= {kv_token:,} B/token) | {kv_token * 1024:,} | {_gib(kv_token * 1024)} |")
    lines.append(f"| KV cache for {settings['context_tokens']:,} tokens | {plan['kv_bytes_context']:,} | "
                 f"{_gib(plan['kv_bytes_context'])} |")
    tb = plan["tree_buffers"]
    lines.append(f"| tree buffers, q = {tb['queries']}: fp32 logits {_mib(tb['logits'])} MiB + activations "
                 f"{_mib(tb['activations'])} MiB + tree mask {_mib(tb['mask'])} MiB | {tb['total']:,} | "
                 f"{_gib(tb['total'])} |")
    for stage in plan["draft_stages"]:
        value = stage["bytes"]
        count = f"{stage['params']:,} parameters, " if stage["params"] else ""
        lines.append(f"| draft stage {stage['where']} ({stage['kind']}): {count}{stage['source']} | "
                     f"{'n/a' if value is None else f'{value:,}'} | {_gib(value)} |")
    if not plan["draft_stages"]:
        lines.append(f"| draft stages: none in pipeline {plan['pipeline']} | 0 | 0.00 |")
    lines += ["", f"### Devices needed ({hw['memory_gib']:g} GiB each)", "",
              "| mode | how | devices | GiB used per device |", "|---|---|---:|---|"]
    for mode in MODES:
        fit = plan["fits"][mode]
        how = MODE_SETTINGS[mode]
        if mode == "tensor parallel":
            how += f"; valid N: {', '.join(map(str, plan['valid_tensor_parallel']))}"
        count = "does not fit" if fit["devices"] is None else str(fit["devices"])
        if settings["gpus"] and fit["devices"] is not None:
            count += " (fits)" if fit["devices"] <= settings["gpus"] else f" (more than {settings['gpus']})"
        used = ", ".join(_gib(b) for b in fit["per_device"]) or fit["detail"]
        lines.append(f"| {mode} | `{how}` | {count} | {used} |")
    lines += ["", "Each device keeps the tree buffers and the draft whole, its layers' KV cache (tensor parallel: "
              "1/N of every layer's) and its share of the quantization scales; a device map is accelerate's "
              "`infer_auto_device_map`, which also keeps the largest layer's size free on device 0, and 8-bit / "
              "4-bit place within 90% of what is left, as transformers' bitsandbytes quantizers ask."]
    lines += _roofline_markdown(plan)
    return "\n".join(lines) + "\n"


def _roofline_markdown(plan: dict) -> list[str]:
    rooflines, hw, dtype = plan["roofline"], plan["hardware"], plan["dtype"]
    if not rooflines:
        return ["", "### Verify step roofline", "", "No mode fits: no roofline."]
    labels = {mode: (f"TP {r['devices']}" if mode == "tensor parallel" else mode) for mode, r in rooflines.items()}
    lines = ["", f"### Verify step roofline (KV {plan['settings']['context_tokens']:,} tokens; ms per step, and "
             f"t(q)/t(1), the cost curve the tree builder uses)", "",
             "| q | " + " | ".join(f"{labels[m]} ms | {labels[m]} t(q)/t(1)" for m in rooflines) + " |",
             "|---:|" + "---:|---:|" * len(rooflines)]
    for i, q in enumerate(plan["settings"]["queries"]):
        cells = []
        for mode, roofline in rooflines.items():
            step = roofline["steps"][i]
            mark = "*" if step["bound"] == "compute" else ""
            cells += [f"{step['ms']:.3f}{mark}", f"{step['ratio']:.3f}"]
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    lines += ["", f"\\* compute bound. time = max(bytes read / bandwidth, FLOPs / peak) at {hw['bandwidth_gbs']:g} "
              f"GB/s and {hw['tflops'][dtype]:g} TFLOPS {dtype} (+ tensor parallel's all-reduces and logits gather at "
              "link bandwidth, latency not modelled); bytes = weights read per device (embedding tables excluded: a "
              "lookup reads q rows) + KV of context + q tokens; FLOPs = 2 x matmul parameters x q + attention 4 x "
              "layers x heads x head_dim x q x (context + q).", ""]
    for mode, roofline in rooflines.items():
        first = roofline["steps"][0]
        ridge = roofline["ridge_queries"]
        at = {s["queries"]: s for s in roofline["steps"]}
        free = [q for q, s in at.items() if s["bound"] == "memory"]
        where = "per device" if mode == "tensor parallel" else "per step (a device map's devices run in turn)"
        lines.append(f"- **{labels[mode]}**: q = 1 reads {_gib(first['bytes'])} GiB {where}, "
                     f"{first['memory_ms']:.3f} ms at {hw['bandwidth_gbs']:g} GB/s"
                     + (f" + {first['comm_ms']:.3f} ms of links" if first["comm_ms"] else "")
                     + f"; ridge point q = {ridge if ridge is not None else 'none'} (memory bound below it: a tree "
                     f"of up to {max(free) if free else 0} of the printed sizes costs t(q)/t(1) <= "
                     f"{max((at[q]['ratio'] for q in free), default=float('nan')):.3f}).")
    return lines


def check_markdown(check: dict, hardware: Hardware) -> str:
    lines = [f"### Checked against task=bench_cost (engine {check['engine']}, KV {check['kv_length']})", ""]
    if not check["measured"]:
        return "\n".join(lines + [f"No cost curve is cached for this model, engine, dtype and CPU "
                                  f"({check['curve_file']}): run `python run.py task=bench_cost` (or "
                                  f"`task=plan plan.measure=true`) to measure one."]) + "\n"
    same_bytes = all(row["engine_weight_bytes"] == check["analytic_weight_bytes"] for row in check["rows"])
    dtype = check["dtype"]
    lines += [f"Curve {check['curve_file']}; roofline at {hardware.bandwidth_gbs:g} GB/s and "
              f"{hardware.tflops[dtype] * 1e3:g} GFLOPS {dtype}"
              + ("" if same_bytes else "; the engine streams other weight bytes than the plan's "
                 f"{check['analytic_weight_bytes']:,} (column 'engine bytes')") + ".", "",
              "| q | roofline ms | " + ("" if same_bytes else "roofline, engine bytes ms | ")
              + "measured ms | measured / roofline | roofline t(q)/t(1) | measured t(q)/t(1) |",
              "|---:|---:|" + ("" if same_bytes else "---:|") + "---:|---:|---:|---:|"]
    for row in check["rows"]:
        engine = "" if same_bytes else f"{row['engine_roofline_ms']:.2f} | "
        lines.append(f"| {row['queries']} | {row['roofline_ms']:.2f} | {engine}{row['measured_ms']:.2f} | "
                     f"{row['measured_over_roofline']:.2f}x | {row['roofline_ratio']:.2f} | "
                     f"{row['measured_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def run_plan(cfg: DictConfig) -> dict:
    settings = read_settings(cfg)
    hardware = load_hardware(cfg)
    shape = model_shape(cfg.model)
    plan = build_plan(cfg, settings, hardware, shape)
    text = markdown(plan)
    check = measured_check(cfg, plan, settings, hardware, shape)
    if check is not None:
        plan["measured_check"] = check
        text += "\n" + check_markdown(check, hardware)
    if settings.measure and hardware.kind == "cpu":
        measured = measure_hardware()
        plan["measured_hardware"] = measured
        text += (f"\nMeasured here now ({measured['threads']} threads): read bandwidth "
                 f"{measured['read_bandwidth_gbs']:.1f} GB/s (hardware config: {hardware.bandwidth_gbs:g}), fp32 "
                 f"matmul peak {measured['fp32_matmul_tflops'] * 1e3:.1f} GFLOPS (config: "
                 f"{hardware.tflops.get('fp32', float('nan')) * 1e3:g}).\n")
    print(text)
    if settings.out is not None:
        from specpipe.tasks.bench_report import write_text

        settings.out.mkdir(parents=True, exist_ok=True)
        write_text(settings.out / "plan.json", json.dumps(plan, indent=1))
        write_text(settings.out / "plan.md", text)
        print(f"plan: written to {settings.out}", file=sys.stderr)
    return plan
