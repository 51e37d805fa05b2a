"""`task=bench_cost` end to end on the tiny random model: curves, op profile, report files, bad settings."""
from __future__ import annotations

import json

import pytest

from specpipe.errors import ConfigError, InvalidRequest
from specpipe.tasks.bench_cost import read_settings, run_bench_cost
from specpipe.pipelines.builder import compose_config
from specpipe.tasks.forward_profile import (BETWEEN_OPS, KERNEL_ATTENTION, KERNEL_NORM, KERNEL_PRODUCT, OTHER_OPS,
                                              TOTAL, profile_forward, row_value, top_ops)

ENGINES = ("transformers", "specpipe-hf", "specpipe-fast")


def cost_config(out, *extra: str):
    return compose_config(["task=bench_cost", "model=tiny_random", "bench_cost.queries=[1,2,4]",
                           "bench_cost.kv_lengths=[16]", "bench_cost.dtypes=[fp32]", "bench_cost.rounds=1",
                           "bench_cost.profile_queries=[1,4]", f"bench_cost.out={out}", *extra])


def test_bench_cost_measures_every_engine_profiles_them_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    report = run_bench_cost(cost_config(out))

    rows = report["rows"]
    assert {(row["engine"], row["queries"]) for row in rows} == {(e, q) for e in ENGINES for q in (1, 2, 4)}
    assert all(row["ms"] > 0 and row["kv_length"] == 16 and row["dtype"] == "fp32" for row in rows)
    for name in ("cost.json", "cost.md", "cost.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "cost.json").read_text())["rows"] == rows

    profiles = report["profiles"]
    assert {(p["engine"], p["queries"]) for p in profiles} == {(e, q) for e in ENGINES for q in (1, 4)}
    for profile in profiles:
        ops = profile["ops"]
        assert ops[TOTAL] > 0 and ops[BETWEEN_OPS] >= 0
        # the linears are where we look: oneDNN's, split GEMMs (bmm) or specpipe's kernel where this CPU takes
        # them, or BLAS
        linear = ({"mkldnn::_linear_pointwise", "aten::bmm", KERNEL_PRODUCT} if profile["engine"] == "specpipe-fast"
                  else {"aten::mm"})
        assert sum(ops.get(name, 0) for name in linear) > 0, (profile["engine"], sorted(ops))
    markdown = (out / "cost.md").read_text()
    assert "Where the time goes: fp32" in markdown and "specpipe-fast q=4" in markdown

    # the physical floor: weight bytes per step over the measured read bandwidth, beside each engine
    bandwidth = report["read_bandwidth_gbs"]
    assert 0.5 < bandwidth < 2000
    floors = {f["engine"]: f for f in report["floors"]}
    assert set(floors) == set(ENGINES)
    for floor in floors.values():
        assert floor["floor_ms"] == pytest.approx(floor["weight_bytes"] / (bandwidth * 1e9) * 1000)
        assert floor["step_ms"] == next(r["ms"] for r in rows if r["engine"] == floor["engine"] and r["queries"] == 1)
        assert floor["x_floor"] == pytest.approx(floor["step_ms"] / floor["floor_ms"])
    assert floors["transformers"]["weight_bytes"] == floors["specpipe-fast"]["weight_bytes"]  # fp32 both
    assert "Memory floor" in markdown and "step / floor" in markdown
    assert "fp32: our 1-token step / memory floor" in {bar["what"] for bar in report["bars"]}
    assert report["machine"]["cpu_capability"] in markdown  # the CPU class is on the report's machine line


def test_streamed_weight_bytes_count_each_weight_once_and_no_embedding_table():
    from specpipe.cost import streamed_weight_bytes
    from specpipe.engine.onednn import OneDNNEngine
    from specpipe.pipelines.builder import load_model

    model = load_model(compose_config(["model=tiny_random"]).model).model
    config = model.config
    embedding = config.vocab_size * config.hidden_size * 4
    parameters = sum(p.numel() * 4 for p in model.parameters())  # tied output layer counted once
    expected = parameters if config.tie_word_embeddings else parameters - embedding
    assert streamed_weight_bytes(model) == expected
    OneDNNEngine().apply(model)
    assert streamed_weight_bytes(model) == expected  # prepacked fp32 weights: the same bytes


def test_the_profile_names_specpipes_kernel_calls_and_leaves_them_as_they_were():
    """The extension is called outside torch's dispatcher: without names its time would count as time
    between ops."""
    from specpipe.engine.onednn import OneDNNEngine
    from specpipe.pipelines.builder import load_model
    from specpipe.target import TargetModel

    model = load_model(compose_config(["model=tiny_random"]).model).model
    OneDNNEngine(fp32_kernel_rows=4).apply(model)
    packed = model.lm_head.packed
    if packed.kernel is None:
        pytest.skip("specpipe's CPU kernel does not build here")
    product, norm, attention = packed.kernel, model.model.norm_kernel, model.model.attention_kernel
    ops = profile_forward(TargetModel(model, engine="fast"), queries=2, kv_length=16, repeats=2)
    assert ops[KERNEL_PRODUCT] > 0 and "mkldnn::_linear_pointwise" not in ops
    assert (KERNEL_NORM in ops) == (norm is not None)
    # a verify's attention in the kernel: no SDPA left in the forward
    assert (KERNEL_ATTENTION in ops) == (attention is not None)
    assert (attention is None) == any("scaled_dot_product" in op for op in ops)
    assert packed.kernel is product and model.model.norm_kernel is norm and model.model.attention_kernel is attention


def test_profile_table_rows_keep_the_top_ops_and_sum_the_rest():
    profiles = [{"a": 5.0, "b": 1.0, "c": 0.5, BETWEEN_OPS: 2.0, TOTAL: 8.5}, {"a": 4.0, "c": 3.0, TOTAL: 7.0}]
    shown = top_ops(profiles, count=2)
    assert shown == ["a", "c", OTHER_OPS, BETWEEN_OPS, TOTAL]
    assert row_value(profiles[0], OTHER_OPS, shown) == 1.0  # "b" only
    assert row_value(profiles[1], "b", shown) == 0.0


@pytest.mark.parametrize("override,message", [
    ("bench_cost.queries=[4,2]", "increasing positive counts"),
    ("bench_cost.kv_lengths=[0]", "must be positive"),
    ("bench_cost.rounds=0", "rounds must be >= 1"),
    ("bench_cost.profile_queries=[0]", "profile_queries must be positive"),
])
def test_bench_cost_refuses_bad_settings(tmp_path, override, message):
    with pytest.raises(InvalidRequest, match=message):
        read_settings(cost_config(tmp_path, override))


def test_bench_cost_refuses_an_unknown_engine(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine 'turbo'.*choose from"):
        read_settings(cost_config(tmp_path, "bench_cost.engines=[turbo]"))


def test_the_stock_forward_verifies_a_branched_tree_as_the_target_does():
    """The cost curves are measured over branched trees (specpipe.cost.random_branches): the stock transformers forward
    that bench_cost times beside the engines gives, over a chain and over two branches, the logits TargetModel gives
    on the same model under engine=hf (ancestor masks and depth positions alike)."""
    import torch

    from specpipe.cost import random_branches, random_chain
    from specpipe.pipelines.builder import load_model
    from specpipe.target import TargetModel
    from specpipe.tasks.bench_cost import TransformersForward

    cfg = compose_config(["model=tiny_random"])
    model = load_model(cfg.model).model
    stock, target = TransformersForward(model, "tiny"), TargetModel(model)
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(0, stock.vocab_size, (20,), generator=generator).tolist()
    for shape in (random_chain, random_branches):
        tree = shape(7, stock.vocab_size, generator)
        stock_cache, target_cache = stock.new_cache(), target.new_cache()
        stock.prefill(context[:-1], stock_cache)
        target.prefill(context[:-1], target_cache)
        expected = target.forward_tree(context[-1], tree, target_cache).logits  # [7, vocab]
        assert torch.equal(stock.forward_tree(context[-1], tree, stock_cache)[0].float(), expected), shape.__name__


def test_an_engine_entry_may_set_the_engines_fields():
    from specpipe.tasks.bench_cost import build_engine_by_name

    assert build_engine_by_name("fast").target_weights == "auto"
    engine = build_engine_by_name("fast target_weights=dense native_rows=8")
    assert (engine.name, engine.target_weights, engine.native_rows) == ("fast", "dense", 8)
    with pytest.raises(ConfigError, match="unknown engine 'fastest'"):
        build_engine_by_name("fastest target_weights=dense")
