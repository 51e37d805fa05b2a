"""Where the target's weights go: `model.device`, accelerate device maps (with disk offload),
quantized loading, and tensor parallel under torchrun (two gloo processes on this CPU).

Every placement must decode exactly what the model in one piece decodes: the device-mapped,
sharded and quantized models all run through the same verify forward and KV commit.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, head_overrides, hf_greedy, random_prompts, run_cli, run_steps, save_model_dir
from specpipe.engine.base import ENGINE_ATTRIBUTE, spread_description
from specpipe.errors import ConfigError, ModelNotAvailable
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model
from specpipe.target import input_device

# `--standalone`: a free port of its own, not torchrun's fixed 29500, which the two torchrun tests would both
# take when the suite runs its tests in parallel processes (`make test`: pytest-xdist)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

PIPELINES = ["vanilla", "lookahead_trie", "prompt_lookup"]
NO_GPU = not torch.cuda.is_available()
# the tiny model's modules, two layers: the second (and the output norm) offloaded to disk
SPLIT_MAP = "{model.embed_tokens: cpu, model.rotary_emb: cpu, model.layers.0: cpu, model.layers.1: disk, " \
            "model.norm: disk, lm_head: cpu}"


@pytest.fixture(scope="module")
def mixed_dir(tiny_mixed):
    """conftest's tiny_mixed (output depends on the context) as a local model directory."""
    folder = save_model_dir(tiny_mixed.reference, tiny_mixed.tokenizer, "tiny-mixed-placement")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def local(folder, *overrides: str) -> list[str]:
    return ["model=local", f"model.path={folder}", "cost_curve=flat", *overrides]


def decodes_like(tiny_mixed, overrides: list[str], prompts: list[list[int]], max_new_tokens: int = 12,
                 reference=None) -> None:
    """Every pipeline on a model loaded with `overrides` gives the greedy output of `reference`
    (HF generate; default: tiny_mixed in one piece) on every prompt."""
    loaded = load_model(compose_config(overrides).model)
    for pipeline in PIPELINES:
        pipe = build_pipeline(compose_config([*overrides, f"pipeline={pipeline}"]), loaded=loaded)
        for i, prompt in enumerate(prompts):
            tokens, _ = run_steps(pipe, prompt, max_new_tokens)
            expected = tiny_mixed.greedy_hf(prompt, max_new_tokens) if reference is None else hf_greedy(
                reference, prompt, max_new_tokens, tiny_mixed.eos_token_ids, tiny_mixed.tokenizer.pad_token_id)
            assert tokens == expected, f"{pipeline}, prompt {i}: {tokens} != {expected}"


def test_every_model_config_has_the_placement_options():
    for option in ("tiny_random", "smollm2_135m", "local", "llama70b"):
        model = compose_config([f"model={option}"]).model
        assert {"device", "device_map", "max_memory", "offload_folder", "tp_plan", "quantization"} <= set(model)
        assert model.device == "cpu" and model.device_map is None


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_device_option_places_the_model(device):
    loaded = load_model(compose_config(["model=tiny_random", f"model.device={device}"]).model)
    expected = "cuda" if device == "auto" and not NO_GPU else "cpu"
    assert {p.device.type for p in loaded.model.parameters()} == {expected}
    assert input_device(loaded.model).type == expected


@pytest.mark.parametrize("overrides,error,message", [
    (["model.device=tpu"], ConfigError, "use cpu, cuda, cuda:N or auto"),
    (["model.device_map=everywhere"], ConfigError, "use one of auto, balanced"),
    (["model.max_memory={cpu: 1GiB}"], ConfigError, "give model.device_map=auto"),
    (["model.device_map=auto", "model.tp_plan=auto"], ConfigError, "give one"),
    (["model.device=auto", "model.device_map=auto"], ConfigError, "leave model.device at its default"),
    (["model.tp_plan=auto"], ConfigError, "torchrun --nproc-per-node N"),
    (["model.quantization=3bit"], ConfigError, "use 8bit or 4bit"),
    (["model.quantization={quant_method: no_such_method}"], ConfigError, "not a transformers quantization config"),
    (["model.quantization=8bit", "model.tp_plan=auto"], ConfigError, "model.quantization with model.tp_plan"),
])
def test_bad_placements_are_clear_errors(overrides, error, message):
    with pytest.raises(error, match=message.replace(".", r"\.")):
        load_model(compose_config(["model=tiny_random", *overrides]).model)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("overrides", [["model.device=cuda"], ["model.device=cuda:1"],
                                       ["model.device_map={model: 0}"], ["model.device_map=auto",
                                                                          "model.max_memory={0: 70GiB}"]])
def test_asking_for_a_gpu_without_one_says_so(overrides):
    with pytest.raises(ModelNotAvailable, match="needs a CUDA GPU.*model.device=cpu"):
        load_model(compose_config(["model=tiny_random", *overrides]).model)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cli_gpu_request_without_a_gpu_is_a_message_not_a_traceback(tmp_path):
    result = run_cli("model=tiny_random", "model.device=cuda", "pipeline=prompt_lookup", cwd=tmp_path)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr + result.stdout


def test_quantization_without_its_library_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ModelNotAvailable, match="pip install bitsandbytes"):
        load_model(compose_config(["model=tiny_random", "model.quantization=4bit"]).model)


def test_a_device_map_that_splits_the_layers_decodes_like_one_piece(tiny_mixed, mixed_dir, tmp_path, caplog):
    """Layer 1 and the final norm offloaded to disk (accelerate's hooks load them per forward): every
    pipeline's output equals greedy decoding of the model in one piece; engine=fast steps aside."""
    overrides = local(mixed_dir, f"model.device_map={SPLIT_MAP}", f"model.offload_folder={tmp_path / 'offload'}")
    loaded = load_model(compose_config(overrides).model)
    assert set(loaded.model.hf_device_map.values()) == {"cpu", "disk"}
    assert {p.device.type for p in loaded.model.model.layers[1].parameters()} == {"meta"}  # really not in memory
    assert input_device(loaded.model).type == "cpu"
    assert "device map" in spread_description(loaded.model)
    with caplog.at_level("WARNING"):
        pipe = build_pipeline(compose_config([*overrides, "pipeline=lookahead_trie", "engine=fast"]), loaded=loaded)
    assert getattr(pipe.target.model, ENGINE_ATTRIBUTE, "hf") == "hf"
    assert "device map" in caplog.text and "running transformers' own forward" in caplog.text
    decodes_like(tiny_mixed, overrides, random_prompts(6, seed=5))


def test_device_map_auto_within_max_memory_offloads_and_decodes_like_one_piece(tiny_mixed, mixed_dir, tmp_path):
    """accelerate plans the map: the 12.6 MB embedding (tied output layer) fits 12.8 MB of CPU memory,
    the decoder layers go to disk."""
    overrides = local(mixed_dir, "model.device_map=auto", "model.max_memory={cpu: 12800000}",
                      f"model.offload_folder={tmp_path / 'offload'}")
    loaded = load_model(compose_config(overrides).model)
    if NO_GPU:
        assert loaded.model.hf_device_map["model.embed_tokens"] == "cpu"
        assert loaded.model.hf_device_map["model.layers"] == "disk"
    decodes_like(tiny_mixed, overrides, random_prompts(4, seed=6))


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_a_quantized_target_decodes_exactly_what_it_would_alone(tiny_mixed, mixed_dir, bits):
    """bitsandbytes (its CPU backend here) through transformers' quantization config: every pipeline
    gives the quantized model's own greedy output, and engine=fast leaves its linears alone."""
    pytest.importorskip("bitsandbytes")
    overrides = local(mixed_dir, f"model.quantization={bits}")
    reference = load_model(compose_config(overrides).model).model
    assert "quantized" in spread_description(reference)
    assert type(reference.model.layers[0].mlp.down_proj).__module__.startswith("bitsandbytes")
    decodes_like(tiny_mixed, overrides, random_prompts(4, seed=7), reference=reference)


def test_tensor_parallel_over_two_gloo_processes_decodes_what_one_process_does(tiny_mixed, mixed_dir, tmp_path):
    """`torchrun --nproc-per-node 2` with model.tp_plan=auto: the weights are DTensor shards, every
    rank decodes the same tokens (greedy under the measured cost curves, and sampling without a seed),
    and greedy output equals the single-process model's, for n-gram drafts, a draft model and heads."""
    prompts, max_new_tokens = random_prompts(4, seed=8), 12
    model = tiny_mixed.loaded.model
    pipelines = {name: [] for name in PIPELINES} | {
        # a draft model of its own on every rank (not sharded), grown by EAGLE-2 under its own cost curve
        "draft_model": [f"pipeline.drafters.model.path={tiny_mixed.self_draft()}",
                        "pipeline.drafters.model.vocab_top_k=0", "pipeline.tree.min_score=0"],
        "eagle": head_overrides("eagle", model),  # heads on the sharded target's gathered hidden states
        "eagle3": head_overrides("eagle3", model)}  # ... and on the hidden states of three of its layers
    prompts_file = tmp_path / "request.json"
    prompts_file.write_text(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens, "pipelines": pipelines}))
    out = tmp_path / "out.json"
    command = [*TORCHRUN, str(REPO / "tests" / "tensor_parallel_worker.py"), str(mixed_dir), str(prompts_file),
               str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["sharded"] == "DTensor"
    assert report["ranks_agree"]
    expected = [tiny_mixed.greedy_hf(prompt, max_new_tokens) for prompt in prompts]
    for pipeline in pipelines:
        assert report["tokens"][pipeline] == expected, pipeline
    assert len(report["tokens"]["sampled"]) == len(prompts)


def test_run_py_under_torchrun_prints_once(mixed_dir, tmp_path):
    command = [*TORCHRUN, str(REPO / "run.py"),
               "model=local", f"model.path={mixed_dir}", "model.tp_plan=auto", "pipeline=lookahead_trie",
               "cost_curve=flat", "max_new_tokens=8", "prompt=one two one two one two"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("[lookahead_trie] 8 tokens") == 1, done.stdout


def _rank_worker(rank: int, world: int, port: int, folder: str) -> None:
    import os
    from pathlib import Path

    import torch.distributed as dist

    from specpipe import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    marker = Path(folder) / "built"
    with distributed.main_process_first():
        if rank == 0:
            import time

            time.sleep(1.0)  # a slow build: rank 1 must wait for it, not start its own
            marker.write_text("rank 0")
        seen = marker.read_text() if marker.exists() else "nothing"
    value = distributed.broadcast_from_main(f"from rank {rank}")
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "value": value}))
    dist.destroy_process_group()


def test_rank_zero_builds_first_and_its_decisions_are_broadcast(tmp_path):
    """What the ranks of a tensor-parallel run share: a store built once by rank 0 (the others wait
    and find it), and rank 0's values (cost curve, sampling seed)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {"seen": "rank 0", "value": "from rank 0"}, rank


def test_tensor_parallel_over_a_count_that_does_not_divide_the_heads_is_refused(mixed_dir, monkeypatch):
    """The tiny model has 4 heads and 2 KV heads: 3 ranks would fail inside a reshape, mid-forward."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="3 processes cannot split this model evenly.*valid up to 3: 1"):
        load_model(compose_config(local(mixed_dir, "model.tp_plan=auto")).model)
