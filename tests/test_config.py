"""Every option of every config group composes and instantiates (groups and options are
discovered from conf/, so new files are covered without touching this test)."""
from __future__ import annotations

import functools
import inspect
import re

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF_DIR, REPO, config_groups, config_options, draft_overrides, eagle3_head_dir, eagle_head_dir, medusa_head_dir, run_cli, tiny_draft_dir
from specpipe.cost import CostCurve
from specpipe.engine.base import Engine
from specpipe.errors import ModelNotAvailable
from specpipe.models import EmbeddedGGUFModel, GGUFFileModel, LocalModel, TinyRandomLlama
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.base import Augmenter, Committer, Proposer, TreeBuilder, Verifier
from specpipe.target import TREE_ATTENTION, TargetModel

DEFAULT_GROUPS = {  # groups in config.yaml's defaults list: `group=option`; others need `+group=option`
    next(iter(entry)) for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]
    if isinstance(entry, dict)
}
# placement: the device options every model config includes (tests/test_placement.py); hardware: the
# device figures task=plan reads (tests/test_plan.py)
STAGE_GROUPS = [g for g in config_groups() if g not in ("model", "pipeline", "task", "store", "placement", "hardware")]
ALL_OPTIONS = [(group, option) for group in config_groups() for option in config_options(group)]
MODELS_WITHOUT_WEIGHTS = {"llama70b", "llama3_8b", "vicuna7b", "local"}


def test_groups_are_discovered():
    groups = set(config_groups())
    assert {"model", "pipeline", "retriever", "tree", "verifier", "task"} <= groups
    assert {"model", "pipeline", "verifier", "task"} <= DEFAULT_GROUPS
    assert MODELS_WITHOUT_WEIGHTS | {"tiny_random", "smollm2_135m"} <= set(config_options("model"))


def override(group: str, option: str) -> str:
    return f"{group}={option}" if group in DEFAULT_GROUPS else f"+{group}={option}"


def test_default_config_composes():
    cfg = compose_config()
    assert cfg.model.name == "smollm2_135m"
    assert cfg.pipeline.name in config_options("pipeline")
    assert cfg.sampling.temperature == 0.0


@pytest.mark.parametrize("group,option", ALL_OPTIONS)
def test_every_option_composes(group, option):
    cfg = compose_config(["model=tiny_random", override(group, option)])
    node = cfg[group] if group != "pipeline" else cfg.pipeline
    assert node is not None
    if "name" in node:
        assert node.name == option, f"conf/{group}/{option}.yaml should be named {option!r}"


@pytest.mark.parametrize("option", config_options("model"))
def test_model_options_instantiate(option, tiny):
    cfg = compose_config([f"model={option}"])
    source = instantiate(cfg.model)
    assert callable(getattr(source, "load", None))
    assert source.name == option
    if isinstance(source, LocalModel) and not source.path:
        assert option in MODELS_WITHOUT_WEIGHTS
        with pytest.raises(ModelNotAvailable, match="model.path="):
            source.load()
    elif isinstance(source, TinyRandomLlama):
        loaded = source.load()
        assert loaded.model.config.num_hidden_layers == cfg.model.num_hidden_layers
        assert loaded.model.config.max_position_embeddings == 2048
        assert loaded.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()
    elif isinstance(source, EmbeddedGGUFModel):
        assert (source.package_folder() / source.gguf_file).is_file()
        assert (source.convert() / "config.json").is_file()  # converted once, then cached
    elif isinstance(source, GGUFFileModel):  # a user's file: nothing to load without model.path
        with pytest.raises(ModelNotAvailable, match="model.path="):
            source.load()
    else:
        pytest.fail(f"model option {option!r}: unknown model source {type(source).__name__}")


@pytest.mark.parametrize("option", sorted(MODELS_WITHOUT_WEIGHTS))
def test_models_without_weights_say_model_path(option):
    source = instantiate(compose_config([f"model={option}"]).model)
    with pytest.raises(ModelNotAvailable) as error:
        source.load()
    assert "model.path=" in str(error.value)


@pytest.mark.parametrize("option", config_options("pipeline"))
def test_pipeline_options_build_and_run(option, tiny_mixed):
    cfg = tiny_mixed.config(option)
    assert cfg.pipeline.name == option
    pipe = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    assert pipe.name == option
    proposers, drafters = cfg.pipeline.get("proposers") or {}, cfg.pipeline.get("drafters") or {}
    assert len(pipe.decoder.proposers) == len(proposers) and len(pipe.decoder.drafters) == len(drafters)
    assert (pipe.decoder.tree_builder is None) == (not (proposers or drafters) or cfg.pipeline.get("tree") is None)
    prompt = [400, 401, 402, 403, 404] * 4
    assert pipe.generate(prompt, max_new_tokens=12).token_ids == tiny_mixed.greedy_hf(prompt, 12)


def complete_partial(stage, model):
    """Fills in what the pipeline builder passes to `_partial_` stages at run time."""
    if not isinstance(stage, functools.partial):
        return stage
    available = {"target": TargetModel(model.loaded.model, name=model.name), "tokenizer": model.tokenizer,
                 "cost_curve": CostCurve.flat()}
    parameters = inspect.signature(stage.func).parameters
    return stage(**{k: v for k, v in available.items() if k in parameters and k not in stage.keywords})


@pytest.mark.parametrize("option", config_options("store"))
def test_store_options_instantiate_a_builder(option, tiny, tmp_path):
    """conf/store/ names store builders for `task=build_store`: each composes through the task and
    instantiates, given what the task hands it, into something with `build()` and an `out` folder."""
    source = tmp_path / "notes.txt"
    source.write_text("Some text to build a store from.")
    cfg = compose_config(["model=tiny_random", "task=build_store", f"store={option}", f"store.out={tmp_path / 'out'}",
                          *([f"store.sources=[{source}]"] if OmegaConf.is_missing(
                              compose_config([f"store={option}"]).store, "sources") else [])])
    builder = complete_partial(instantiate(cfg.store), tiny)
    assert callable(getattr(builder, "build", None)) and str(builder.out) == str(tmp_path / "out")


@pytest.mark.parametrize("group,option", [(g, o) for g in STAGE_GROUPS for o in config_options(g)])
def test_stage_options_instantiate(group, option, tiny):
    # drafters fitted to the tiny model: the default draft is the embedded model's, layer_skip's layers its
    fitted = {("drafter", "draft_model"): [f"drafter.path={tiny_draft_dir()}"],
              ("drafter", "layer_skip"): ["drafter.layers=[0]"],
              ("drafter", "eagle"): [f"drafter.path={eagle_head_dir(tiny.loaded.model.config)}",
                                     "drafter.vocab_top_k=0"],
              ("drafter", "eagle3"): [f"drafter.path={eagle3_head_dir(tiny.loaded.model)}"],
              ("drafter", "hydra"): [f"drafter.path={medusa_head_dir(tiny.loaded.model.config, hydra=True)}",
                                     "drafter.vocab_top_k=0"],
              ("drafter", "medusa"): [f"drafter.path={medusa_head_dir(tiny.loaded.model.config)}",
                                      "drafter.vocab_top_k=0"]}.get((group, option), [])
    cfg = compose_config(["model=tiny_random", override(group, option), *fitted])
    stage = complete_partial(instantiate(cfg[group]), tiny)
    protocol = {"tree": TreeBuilder, "verifier": Verifier, "engine": Engine, "augment": Augmenter,
                "commit": Committer}.get(group, Proposer)
    assert isinstance(stage, protocol), f"{group}/{option} -> {type(stage).__name__} is not a {protocol.__name__}"
    if group == "tree":
        assert stage.cost_curve == CostCurve.flat()


@pytest.mark.parametrize("attention", ["auto", "sdpa", "triton"])
def test_attention_options_build_and_run(attention, tiny):
    """`attention=` is a top-level key, not a group: every value builds and decodes like plain greedy
    (triton runs interpreted here: conftest sets TRITON_INTERPRET=1)."""
    assert compose_config().attention == "auto"
    expected = TREE_ATTENTION  # auto is SDPA on CPU
    if attention == "triton":
        pytest.importorskip("triton")
        from specpipe.kernels.tree_attention import TRITON_TREE_ATTENTION as expected
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=prompt_lookup", "cost_curve=flat",
                                          f"attention={attention}"]), loaded=tiny.loaded)
    assert pipe.target.attn_implementation == expected
    prompt = [400, 401, 402, 403] * 3
    assert pipe.generate(prompt, max_new_tokens=6).token_ids == tiny.greedy_hf(prompt, 6)


@pytest.mark.parametrize("option", config_options("task"))
def test_task_options_compose(option):
    cfg = compose_config([f"task={option}"])
    assert cfg.task.name == option


def compose_with_hydra(overrides: list[str]):
    """The config with its `hydra` node (launchers, hydra.* overrides), as `run.py` composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("launcher,target", [
    ("basic", "BasicLauncher"), ("joblib", "JoblibLauncher"), ("submitit_local", "LocalLauncher"),
    ("submitit_slurm", "SlurmLauncher"), ("slurm_gpu", "SlurmLauncher")])
def test_sweep_launchers_compose(launcher, target):
    """The Hydra launcher plugins are installed and the project's own Slurm preset composes on them."""
    cfg = compose_with_hydra([f"hydra/launcher={launcher}", "task=bench"])
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "slurm_gpu":
        assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.additional_parameters.exclusive


def test_cli_missing_model_weights_is_a_clear_error(tmp_path):
    result = run_cli("model=llama70b", "pipeline=prompt_lookup", cwd=tmp_path)
    assert result.returncode != 0
    assert "model.path=" in result.stderr
    assert "never downloads weights" in result.stderr  # stopped before any download, not after a slow one
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_generates_on_the_tiny_model(tmp_path):
    result = run_cli("model=tiny_random", "pipeline=prompt_lookup", "cost_curve=flat", "max_new_tokens=6",
                     "prompt=hello hello hello", "chat_template=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[prompt_lookup]" in result.stdout and "6 tokens" in result.stdout


@pytest.mark.parametrize("pipeline", config_options("pipeline"))
def test_bf16_builds_and_generates(pipeline):
    """bf16 runs end to end (exactness is an fp32 property; here: the right number of tokens, each a
    valid id, and the first one the argmax of the prompt's logits)."""
    cfg = compose_config(["model=tiny_random", "model.dtype=bf16", f"pipeline={pipeline}", "cost_curve=flat",
                          *draft_overrides(pipeline, "bf16")])
    pipe = build_pipeline(cfg)
    assert pipe.target.dtype == torch.bfloat16
    prompt = [500, 501, 502, 503] * 5
    out = pipe.generate(prompt, max_new_tokens=16)
    assert len(out.token_ids) == 16 and all(0 <= t < 49152 for t in out.token_ids)
    with torch.inference_mode():
        first = pipe.target.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax()
    assert out.token_ids[0] == int(first)


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `run.py` command in the shell blocks of the README and the docs pages (docs/*.md, docs/pipelines/;
    the lab notebook, docs/notebook/, records past commands as they were): (file, its arguments),
    continuation lines joined, $HOME expanded as the shell would, redirections and comments dropped."""
    import os
    import shlex

    root = REPO
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "docs" / "pipelines").glob("*.md"))]
    commands = []
    for page in pages:
        name = str(page.relative_to(root))
        text = page.read_text()
        for block in re.findall(r"```(?:bash|sh|shell)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "run.py" not in line and "specpipe " not in line:
                    continue
                words = shlex.split(os.path.expandvars(line), comments=True)
                # run.py in a checkout; `specpipe` and `python -m specpipe` where the package is installed
                entry = next((i for i, word in enumerate(words) if word == "run.py" or
                              (word == "specpipe" and (i == 0 or words[i - 1] == "-m"))), None)
                if entry is None:
                    continue
                args = words[entry + 1:]
                ends = [i for i, word in enumerate(args) if word in ("&", "&&", "|", ">", ">>", "2>&1")]
                commands.append((name, args[: ends[0]] if ends else args))
    return commands


def test_documented_commands_compose():
    """The overrides of every command the docs tell users to run parse and name keys that exist (the
    README's reproduction command once passed an unquoted `~`, which Hydra's override grammar refuses).
    Sweeps (-m) compose one value of each swept override; launcher and hydra.* overrides are composed
    with the Hydra config."""
    commands = documented_commands()
    assert len(commands) >= 30  # the documented commands were found
    assert {"README.md", "docs/SCALING.md", "docs/getting-started.md"} <= {name for name, _ in commands}
    failures = []
    for name, args in commands:
        overrides = [arg for arg in args if arg not in ("-m", "--multirun")]
        if "-m" in args or "--multirun" in args:  # a sweep: its first value of each swept key
            overrides = [re.sub(r"=([^,\[{'\"]+),.*$", r"=\1", arg) for arg in overrides]
        try:
            compose_with_hydra(overrides)
        except Exception as error:  # noqa: BLE001 (every failure is collected and reported)
            failures.append(f"{name}: run.py {' '.join(args)}\n    {type(error).__name__}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)
