"""The capacity plan of `task=plan` as people read it: the markdown that `specpipe.tasks.plan` prints and
writes as plan.md, from the plan's JSON-ready dict (`specpipe.tasks.plan_build.build_plan`), with the
memory table, the devices each placement mode needs and how to ask for it in this project's placement
options, the verify step's roofline per mode and, on a CPU, the check against a measured cost curve.
Kept apart from the plan's arithmetic so that the numbers in plan.json and the words around them in
plan.md change independently.
"""
from __future__ import annotations

from specpipe import capacity
from specpipe.capacity import GIB, Hardware
from specpipe.tasks.plan_build import MODES

# How each mode is asked for in this project's placement options (conf/placement/defaults.yaml).
MODE_SETTINGS = {"device map": "model.device_map=auto",
                 "tensor parallel": "torchrun --nproc-per-node N ... model.tp_plan=auto",
                 "8-bit": "model.quantization=8bit model.device_map=auto",
                 "4-bit": "model.quantization=4bit model.device_map=auto"}


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:,.2f}"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f}"


def markdown(plan: dict) -> str:
    """The plan's tables: memory, devices needed per mode and the verify step's roofline."""
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
    """The measured cost curve beside the roofline, or how to measure one when none is cached."""
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


def measured_hardware_markdown(measured: dict, hardware: Hardware) -> str:
    """The CPU's read bandwidth and matmul peak measured now, beside what the hardware config says."""
    return (f"\nMeasured here now ({measured['threads']} threads): read bandwidth "
            f"{measured['read_bandwidth_gbs']:.1f} GB/s (hardware config: {hardware.bandwidth_gbs:g}), fp32 "
            f"matmul peak {measured['fp32_matmul_tflops'] * 1e3:.1f} GFLOPS (config: "
            f"{hardware.tflops.get('fp32', float('nan')) * 1e3:g}).\n")
