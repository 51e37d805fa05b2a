"""`task=plan`: the capacity arithmetic on known models is exact, and the task prints the plan."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig

from conftest import config_options, eagle_head_dir, run_cli, tiny_draft_dir
from specpipe import capacity
from specpipe.capacity import GIB, Architecture, Hardware, StepModel
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import compose_config
from specpipe.tasks.plan import load_hardware, read_settings, run_plan
from specpipe.tasks.plan_build import quantizer_max_memory

# The public config.json fields of meta-llama/Llama-3.1-8B and -70B that size them.
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LLAMA_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
# A GPU sized like the H100 80GB datasheet (conf/hardware/h100_80gb.yaml), written here so that a
# change of the config file cannot move these expectations.
H100 = Hardware("h100", "test H100", "gpu", 80, 3350, {"bf16": 989.5}, 900)
CONTEXT = 8192
HEADROOM = 0.10


def sized(fields: dict):
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = capacity.build_meta_model(config)
    return Architecture.from_config(config), model, capacity.inventory(model)


@pytest.fixture(scope="module")
def llama8b():
    return sized(LLAMA_8B)


@pytest.fixture(scope="module")
def llama70b():
    return sized(LLAMA_70B)


def test_parameter_counts_and_weight_bytes_are_exact(llama8b, llama70b):
    from specpipe.cost import streamed_weight_bytes

    for (arch, model, inv), total, kv in ((llama8b, 8_030_261_248, 131_072), (llama70b, 70_553_706_496, 327_680)):
        assert inv.total == total == sum(p.numel() for p in model.parameters())
        assert capacity.precision("bf16", "bf16").total_bytes(inv) == 2 * total
        assert capacity.precision("fp32", "bf16").total_bytes(inv) == 4 * total
        assert capacity.kv_bytes_per_token(arch, 2) == kv
        # untied: the input embedding is not streamed; everything else is, as bench_cost counts it
        embedding = arch.vocab_size * arch.hidden_size
        assert inv.embedding == embedding and inv.streamed == total - embedding
        assert streamed_weight_bytes(model) == 4 * inv.streamed  # meta tensors are fp32
    # Llama-3.1-8B by hand: per layer q, o 4096^2; k, v 4096 x 1024; gate, up, down 4096 x 14336
    arch, _, inv = llama8b
    linears = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert inv.quantizable == 32 * linears == 6_979_321_856
    assert inv.quantizable_rows == 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    rest = 8_030_261_248 - 6_979_321_856  # embeddings, output layer and norms stay bf16
    assert capacity.precision("int8", "bf16").total_bytes(inv) == 6_979_321_856 + 4 * 1_376_256 + 2 * rest
    assert capacity.precision("int4", "bf16").total_bytes(inv) == \
        6_979_321_856 // 2 + 4 * 6_979_321_856 // 64 + 2 * rest


def test_quantized_bytes_match_bitsandbytes(tmp_path):
    """The 8-bit and 4-bit sizes are bitsandbytes' own: a small Llama quantized by transformers holds
    exactly the weight bytes (get_memory_footprint) and scale bytes the plan counts."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path / "bnb"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    inv = capacity.inventory(capacity.build_meta_model(config))
    for name, quantization in (("int8", BitsAndBytesConfig(load_in_8bit=True)),
                               ("int4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quantization)
        scales = 0
        for parameter in model.parameters():
            state = getattr(parameter, "quant_state", None)
            scales += state.absmax.numel() * state.absmax.element_size() if state is not None else 0
            row_scales = getattr(parameter, "SCB", None)
            scales += row_scales.numel() * row_scales.element_size() if row_scales is not None else 0
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        plan = capacity.precision(name, "bf16")
        assert plan.scales(inv) == scales > 0
        assert plan.total_bytes(inv) - plan.scales(inv) == model.get_memory_footprint() - buffers


def test_tensor_parallel_ranks_must_split_heads_evenly(llama70b):
    assert capacity.valid_tensor_parallel(llama70b[0], 64) == [1, 2, 4, 8]
    smollm = Architecture("llama", 576, 1536, 30, 9, 3, 64, 49152, True)
    assert capacity.valid_tensor_parallel(smollm, 16) == [1, 3]
    vicuna = Architecture("llama", 4096, 11008, 32, 32, 32, 128, 32000, False)
    assert capacity.valid_tensor_parallel(vicuna, 64) == [1, 2, 4, 8, 16, 32]


def _fits(arch, model, inv, hardware=H100):
    usable = hardware.usable_bytes(HEADROOM)
    kv_total = capacity.kv_bytes_per_token(arch, 2) * CONTEXT
    buffers = capacity.tree_buffers(arch, 128, CONTEXT, 2).total
    fits = {"tensor parallel": capacity.tensor_parallel_fit(inv, capacity.precision("bf16", "bf16"), kv_total, buffers,
                                                            usable, capacity.valid_tensor_parallel(arch, 64))}
    for mode, name in (("device map", "bf16"), ("8-bit", "int8"), ("4-bit", "int4")):
        precision = capacity.precision(name, "bf16")
        fits[mode] = capacity.device_map_fit(model, precision, kv_total // arch.num_hidden_layers, buffers, usable, 64,
                                             mode, quantizer_max_memory(precision, "bf16"))
    return fits, kv_total, buffers, usable


def test_devices_needed_per_mode(llama8b, llama70b):
    arch, model, inv = llama70b
    fits, kv_total, buffers, usable = _fits(arch, model, inv)
    assert usable == int(80 * GIB * 0.9)
    # tree buffers for q = 128 over 8192 + 128 keys: fp32 logits, residual + gate/up rows in bf16, bool mask
    assert buffers == 128 * 128256 * 4 + 128 * (8192 + 2 * 28672) * 2 + 128 * (8192 + 128) == 83_509_248
    # 8-bit: 67.7 GiB of weights and 2.5 of KV are under 72 usable, but transformers' bitsandbytes
    # quantizer places within 90% of what is left after the KV: two devices
    assert {mode: fit.devices for mode, fit in fits.items()} == \
        {"device map": 2, "tensor parallel": 2, "8-bit": 2, "4-bit": 1}
    # tensor parallel by hand: all but the norms split two ways, the KV heads too, buffers on each rank
    norms = 80 * 2 * 8192 + 8192
    assert inv.split == inv.total - norms
    per_rank = (inv.total - norms) * 2 // 2 + norms * 2 + kv_total // 2 + buffers
    assert fits["tensor parallel"].per_device == (per_rank, per_rank) and per_rank <= usable < 2 * per_rank
    # the device map spends what accelerate placed (weights and rotary buffers), the KV of each
    # device's layers and the buffers on both devices
    rotary = sum(b.numel() for b in model.buffers()) * 2
    assert sum(fits["device map"].per_device) == 2 * inv.total + rotary + kv_total + 2 * buffers
    assert all(used <= usable for fit in fits.values() for used in fit.per_device)
    arch, model, inv = llama8b
    fits, *_ = _fits(arch, model, inv)
    assert {mode: fit.devices for mode, fit in fits.items()} == \
        {"device map": 1, "tensor parallel": 1, "8-bit": 1, "4-bit": 1}
    # on 40 GiB devices (36 usable) Llama-3.1-70B needs 4 in bf16 (131.4 GiB of weights), 3 in 8-bit
    # (67.7 GiB placed within 90%) and 2 in 4-bit (39.8)
    half = Hardware("a100_40", "40 GiB", "gpu", 40, 1555, {"bf16": 312.0}, 600)
    fits, *_ = _fits(*llama70b, hardware=half)
    assert {mode: fit.devices for mode, fit in fits.items()} == \
        {"device map": 4, "tensor parallel": 4, "8-bit": 3, "4-bit": 2}


def test_roofline_time_by_hand(llama8b, llama70b):
    arch, _, inv = llama8b
    step = StepModel(arch, inv, capacity.precision("bf16", "bf16"), CONTEXT)
    cost = capacity.step_cost(step, H100, 1, "bf16")
    # bytes: streamed weights in bf16 (all but the input embedding) + the KV of 8192 + 1 tokens
    assert cost.bytes == 7_504_924_672 * 2 + 131_072 * 8193 == 16_083_722_240
    # FLOPs: 2 x (linears + output layer) + attention 4 x 32 layers x 32 heads x 128 x (8192 + 1)
    assert cost.flops == 2 * 7_504_658_432 + 4 * 32 * 32 * 128 * 8193
    assert cost.ms == pytest.approx(16_083_722_240 / 3.35e12 * 1e3, rel=1e-12)  # 4.801 ms, memory bound
    assert cost.bound == "memory" and cost.comm_ms == 0
    # the ridge point solves flops(q) / peak = bytes(q) / bandwidth: A q^2 + (2M + A C - K P/B) q - (W + K C) P/B = 0
    a, m, k, w = 4 * 32 * 32 * 128, 7_504_658_432, 131_072, 7_504_924_672 * 2
    ratio = 989.5e12 / 3350e9
    b, c = 2 * m + a * CONTEXT - k * ratio, (w + k * CONTEXT) * ratio
    ridge = math.ceil((-b + math.sqrt(b * b + 4 * a * c)) / (2 * a))
    assert capacity.ridge_queries(step, H100, "bf16") == ridge
    assert capacity.step_cost(step, H100, ridge, "bf16").bound == "compute"
    assert capacity.step_cost(step, H100, ridge - 1, "bf16").bound == "memory"
    # tensor parallel over 2 H100: each rank reads half the split weights and KV heads, and sends
    # 161 all-reduces of q x 8192 bf16 (2 (N-1)/N of each) and half of the q x vocab logits, at 450 GB/s
    arch, _, inv = llama70b
    step = StepModel(arch, inv, capacity.precision("bf16", "bf16"), CONTEXT, ranks=2)
    cost = capacity.step_cost(step, H100, 1, "bf16")
    norms = 80 * 2 * 8192 + 8192
    streamed_split = 70_553_706_496 - 128256 * 8192 - norms
    assert cost.bytes == streamed_split * 2 // 2 + norms * 2 + 327_680 * 8193 // 2
    assert cost.comm_ms == pytest.approx((161 * 1 * 8192 * 2 + 128256 * 2 / 2) / 450e9 * 1e3, rel=1e-12)
    assert cost.ms == pytest.approx(cost.bytes / 3.35e12 * 1e3 + cost.comm_ms, rel=1e-12)


def test_every_hardware_config_loads():
    options = config_options("hardware")
    assert {"h100_80gb", "h200_141gb", "cpu_epyc_2core"} <= set(options)
    for option in options:
        cfg = compose_config([f"hardware={option}", "task=plan"])
        hardware = load_hardware(cfg)
        assert hardware.name == option and hardware.memory_bytes > 0 and hardware.bandwidth_gbs > 0
    default = load_hardware(compose_config(["task=plan"]))
    assert default.name == "cpu_epyc_2core" and default.kind == "cpu" and default.max_devices == 1


def test_plan_on_the_tiny_model_prints_the_tables(tmp_path, capsys):
    plan = run_plan(compose_config(["model=tiny_random", "task=plan", f"plan.out={tmp_path}"]))
    text = capsys.readouterr().out
    for heading in ("### Memory", "### Devices needed", "### Verify step roofline", "ridge point q ="):
        assert heading in text
    # tied embedding, 2 layers of q, o 64 x 64, k, v 64 x 32 (2 KV heads of 16), MLP 3 x 64 x 128, 2 norms; final norm
    assert plan["parameters"]["total"] == 49152 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert json.loads((tmp_path / "plan.json").read_text())["fits"] == plan["fits"]
    assert plan["fits"]["device map"]["devices"] == 1


def test_plan_checks_the_roofline_against_a_cached_cost_curve(tmp_path, capsys, monkeypatch):
    """On the CPU the stored bench_cost curve is printed beside the roofline; none stored: a pointer to bench_cost."""
    from specpipe import cost
    from specpipe.tasks.plan import plan_target

    monkeypatch.setattr(cost, "cache_root", lambda: tmp_path)
    cfg = compose_config(["model=tiny_random", "task=plan", "plan.queries=[1,4]"])
    run_plan(cfg)
    assert "No cost curve is cached" in capsys.readouterr().out
    cost.store_cost_curve(plan_target(cfg), cost.CostCurve((1, 4), (2.0, 3.0)))
    plan = run_plan(cfg)
    text = capsys.readouterr().out
    rows = plan["measured_check"]["rows"]
    assert [row["measured_ms"] for row in rows] == [2.0, 3.0]
    assert rows[1]["measured_ratio"] == 1.5
    assert rows[0]["measured_over_roofline"] == pytest.approx(2.0 / rows[0]["engine_roofline_ms"])
    assert "| 4 | " in text and "measured / roofline" in text


def test_draft_stage_parameters_come_from_the_checkpoint(tiny, capsys):
    from safetensors.torch import load_file

    from specpipe.stages.draft.eagle_checkpoint import BASE_MODEL_KEYS

    head = eagle_head_dir(tiny.loaded.model.config)
    plan = run_plan(compose_config(["model=tiny_random", "task=plan", "pipeline=eagle",
                                    f"pipeline.drafters.eagle.path={head}"]))
    expected = sum(t.numel() for key, t in load_file(head / "model.safetensors").items() if key not in BASE_MODEL_KEYS)
    (stage,) = plan["draft_stages"]
    assert stage["params"] == expected and stage["bytes"] == 4 * expected
    capsys.readouterr()
    plan = run_plan(compose_config(["model=llama70b", "task=plan", "hardware=h100_80gb", "pipeline=eagle"]))
    (stage,) = plan["draft_stages"]
    assert stage["params"] is None and stage["source"].startswith("n/a")
    assert "| n/a | n/a |" in capsys.readouterr().out


def test_cli_plans_llama70b_on_h100(tmp_path):
    result = run_cli("task=plan", "model=llama70b", "hardware=h100_80gb", "plan.gpus=4", f"plan.out={tmp_path}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Capacity plan: llama70b (bf16) on NVIDIA H100 SXM5 80GB, 4 at hand" in out
    assert "| weights bf16 / fp16 | 141,107,412,992 |" in out
    assert "| device map | `model.device_map=auto` | 2 (fits) |" in out
    assert "valid N: 1, 2, 4, 8" in out and "TP 4 ms" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["roofline"]["tensor parallel"]["devices"] == 4
    assert plan["fits"]["4-bit"]["devices"] == 1


def test_plan_reads_the_config_json_of_model_path(capsys):
    """model.path wins: its config.json is the architecture (here a saved 1-layer tiny Llama)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_draft_dir()
    plan = run_plan(compose_config(["model=local", f"model.path={folder}", "task=plan", "hardware=h100_80gb"]))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert plan["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    assert plan["architecture"]["num_hidden_layers"] == 1
    capsys.readouterr()


def test_a_model_without_architecture_or_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="neither model.path .* nor model.architecture"):
        run_plan(compose_config(["model=local", "task=plan"]))
    result = run_cli("task=plan", "model=local", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    assert "model.architecture" in result.stderr and "model.path" in result.stderr


@pytest.mark.parametrize("override,message", [
    ("plan.queries=[4,2]", "increasing positive counts"),
    ("plan.gpus=0", "positive count"),
    ("plan.headroom=1.5", r"\[0, 1\)"),
])
def test_plan_refuses_bad_settings(override, message):
    from specpipe.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=message):
        read_settings(compose_config(["task=plan", override]))
