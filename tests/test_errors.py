"""Bad input gives a clear SpecpipeError (no raw traceback) and loses nothing: the same pipeline
serves a good request right after. Also the Python API's generate/stream contract."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from conftest import random_prompts, run_cli
from specpipe.errors import ConfigError, InvalidRequest, ModelNotAvailable, SpecpipeError
from specpipe.models import cache_root
from specpipe.pipelines.builder import build_pipeline, check_same_tokenizer, compose_config, load_model
from specpipe.types import SamplingConfig

GOOD_PROMPT = [400, 401, 402, 403, 404] * 4


@pytest.fixture
def pipe(tiny_mixed):
    """A drafting pipeline, checked to still serve a good request after each test's bad one."""
    pipeline = tiny_mixed.pipeline("lookahead_trie")
    yield pipeline
    assert pipeline.generate(GOOD_PROMPT, max_new_tokens=10).token_ids == tiny_mixed.greedy_hf(GOOD_PROMPT, 10)
    assert pipeline.generate("hello hello hello", max_new_tokens=3, chat_template=False).stats.new_tokens == 3


def test_error_hierarchy():
    for error in (ConfigError, InvalidRequest, ModelNotAvailable):
        assert issubclass(error, SpecpipeError)


# ---- config errors -----------------------------------------------------------------------------

def test_unknown_pipeline_lists_options():
    with pytest.raises(ConfigError) as error:
        compose_config(["pipeline=nope"])
    message = str(error.value)
    assert "Could not find" in message and "nope" in message
    for option in ("vanilla", "prompt_lookup", "lookahead_trie"):
        assert option in message


def test_a_missing_config_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config_dirs: no such folder: .*nowhere"):
        compose_config(["pipeline=mine"], config_dirs=[tmp_path / "nowhere"])


def test_a_pipeline_from_an_own_config_folder_composes_beside_the_shipped_ones(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - lookahead_trie\n  - _self_\n\npipeline:\n  name: mine\n")
    config = compose_config(["pipeline=mine"], config_dirs=[tmp_path])
    assert config.pipeline.name == "mine" and "ngram" in config.pipeline.proposers
    with pytest.raises(ConfigError, match="mine"):  # not found without the folder
        compose_config(["pipeline=mine"])


@pytest.mark.parametrize("override,group,options", [
    ("retriever@pipeline.proposers.ngram=nope", "retriever", ("prompt_ngram", "ngram_trie")),
    ("tree@pipeline.tree=nope", "tree", ("trie",)),
    ("verifier=nope", "verifier", ("greedy",)),
])
def test_unknown_stage_lists_options(override, group, options):
    with pytest.raises(ConfigError) as error:
        compose_config(["pipeline=prompt_lookup", override])
    message = str(error.value)
    assert f"Could not find '{group}/nope'" in message
    for option in options:
        assert option in message


def test_stage_with_unknown_class_is_a_config_error(tiny):
    cfg = tiny.config("prompt_lookup", "pipeline.proposers.ngram._target_=specpipe.stages.retrieve.nope.Nope")
    with pytest.raises(ConfigError, match="pipeline.proposers.ngram"):
        build_pipeline(cfg, loaded=tiny.loaded)


def test_bad_stage_argument_is_a_config_error(tiny):
    cfg = tiny.config("prompt_lookup", "pipeline.proposers.ngram.max_matches=0")
    with pytest.raises(ConfigError, match="max_matches"):
        build_pipeline(cfg, loaded=tiny.loaded)


def test_bad_cost_curve_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="cost_curve"):
        build_pipeline(tiny.config("prompt_lookup", cost_curve="sometimes"), loaded=tiny.loaded)


@pytest.mark.parametrize("settings,key", [
    ({"temperature": -1.0}, "sampling.temperature"), ({"temperature": float("nan")}, "sampling.temperature"),
    ({"temperature": 0.7, "top_k": -5}, "sampling.top_k"), ({"temperature": 0.7, "top_k": 2.5}, "sampling.top_k"),
    ({"temperature": 0.7, "top_p": 0.0}, "sampling.top_p"), ({"temperature": 0.7, "top_p": 1.5}, "sampling.top_p"),
])
def test_bad_sampling_settings_are_refused_before_decoding(tiny, settings, key):
    """A negative temperature used to decode greedily without a word, a negative top_k to fail mid-answer
    in torch.topk: both are refused where they are set, from the API and from the config alike."""
    with pytest.raises(InvalidRequest, match=key):
        SamplingConfig(**settings)
    overrides = [f"sampling.{name}={value}" for name, value in settings.items()]
    with pytest.raises(InvalidRequest, match=key):
        build_pipeline(tiny.config("prompt_lookup", "verifier=rejection", *overrides), loaded=tiny.loaded)


@pytest.mark.parametrize("tree,override,key", [
    ("trie", "pipeline.tree.max_nodes=0", "pipeline.tree.max_nodes"),
    ("trie", "pipeline.tree.min_gain=-1", "pipeline.tree.min_gain"),
    ("eagle2", "pipeline.tree.depth=0", "pipeline.tree.depth"),
    ("eagle2", "pipeline.tree.top_k=-2", "pipeline.tree.top_k"),
    ("eagle2", "pipeline.tree.children=0", "pipeline.tree.children"),
    ("eagle2", "pipeline.tree.max_nodes=0", "pipeline.tree.max_nodes"),
    ("eagle2", "pipeline.tree.min_score=-1", "pipeline.tree.min_score"),
    ("static", "pipeline.tree.max_nodes=0", "pipeline.tree.max_nodes"),
    ("trie", "+pipeline.tree.bogus=1", "bogus"),
])
def test_bad_tree_settings_are_config_errors_naming_the_key(tiny, tree, override, key):
    """The tree builders are `_partial_` stages the pipeline builder completes with the cost curve: what
    they refuse, or a key they do not take, must come out as a ConfigError, not a raw traceback."""
    cfg = tiny.config("lookahead_trie", f"tree@pipeline.tree={tree}", override)
    with pytest.raises(ConfigError, match=key):
        build_pipeline(cfg, loaded=tiny.loaded)


def test_cli_bad_tree_setting_has_no_traceback(tmp_path):
    result = run_cli("model=tiny_random", "pipeline=lookahead_trie", "tree@pipeline.tree=eagle2",
                     "pipeline.tree.depth=0", "prompt=hello", cwd=tmp_path)
    output = result.stderr + result.stdout
    assert result.returncode == 2, output
    assert "specpipe: error:" in output and "pipeline.tree.depth must be >= 1" in output
    assert "Traceback" not in output


def test_relative_drafter_paths_read_the_current_directory_first_then_the_repository(tmp_path, monkeypatch):
    from specpipe.paths import DATA_DIR, local_path
    from specpipe.stages.draft.head_checkpoint import head_folder

    monkeypatch.chdir(tmp_path)
    shipped = head_folder("data/medusa/smollm2_135m", "unused", "medusa", "Medusa heads", "train")
    assert shipped == DATA_DIR / "medusa" / "smollm2_135m" and shipped.is_dir()
    (tmp_path / "data" / "medusa" / "smollm2_135m").mkdir(parents=True)  # a user's own folder of that name wins
    assert local_path("data/medusa/smollm2_135m") == Path("data/medusa/smollm2_135m")
    assert local_path("nowhere/at/all") == Path("nowhere/at/all")  # neither: the loader says what is missing


def test_cli_unknown_pipeline(tmp_path):
    result = run_cli("pipeline=nope", cwd=tmp_path)
    assert result.returncode != 0
    output = result.stderr + result.stdout
    assert "Could not find" in output and "prompt_lookup" in output and "vanilla" in output
    assert "Traceback" not in output


def test_missing_local_model_path():
    cfg = compose_config(["model=local", "model.path=/nonexistent"])
    with pytest.raises(ModelNotAvailable) as error:
        load_model(cfg.model)
    assert "/nonexistent" in str(error.value) and "does not exist" in str(error.value)
    assert "model.path=" in str(error.value)


def test_local_model_dir_without_config(tmp_path):
    cfg = compose_config(["model=local", f"model.path={tmp_path}"])
    with pytest.raises(ModelNotAvailable, match="config.json"):
        load_model(cfg.model)


def test_local_model_loads_a_real_directory(embedded):
    """model=local on the converted embedded model's directory loads (the happy path of the same class)."""
    folder = cache_root() / "models" / "smollm2_135m"
    loaded = load_model(compose_config(["model=local", f"model.path={folder}"]).model)
    assert loaded.name == "local"
    assert loaded.tokenizer.get_vocab() == embedded.tokenizer.get_vocab()
    assert next(loaded.model.parameters()).dtype == torch.float32
    for (name, mine), (_, theirs) in zip(loaded.model.state_dict().items(), embedded.reference.state_dict().items()):
        assert torch.equal(mine, theirs), name


def test_bad_dtype_is_a_config_error():
    cfg = compose_config(["model=tiny_random", "model.dtype=int3"])
    with pytest.raises(ConfigError, match="dtype"):
        load_model(cfg.model)


def test_drafter_tokenizer_must_match(tiny):
    folder = cache_root() / "models" / "smollm2_135m"
    same = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    check_same_tokenizer(tiny.tokenizer, same, "drafter")  # a second load of the same tokenizer is fine
    other = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    other.add_tokens(["<specpipe-extra-token>"])
    with pytest.raises(ConfigError) as error:
        check_same_tokenizer(tiny.tokenizer, other, "drafter")
    assert "drafter" in str(error.value) and "tokenizer" in str(error.value)
    # Same size, different ids: also refused.
    swapped = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    vocab = swapped.get_vocab()
    assert len(swapped) == len(tiny.tokenizer)

    class Swapped:
        def __len__(self):
            return len(vocab)

        def get_vocab(self):
            changed = dict(vocab)
            a, b = "hello", "world"
            changed[a], changed[b] = vocab[b], vocab[a]
            return changed

    with pytest.raises(ConfigError):
        check_same_tokenizer(tiny.tokenizer, Swapped(), "drafter")


def test_sampling_with_greedy_verifier_is_a_config_error(tiny):
    with pytest.raises(ConfigError) as error:
        build_pipeline(tiny.config("prompt_lookup", "sampling.temperature=0.7"), loaded=tiny.loaded)
    assert "temperature" in str(error.value)


# ---- request errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", "   \n\t ", [], [{"role": "user", "content": "   "}]],
                         ids=["empty", "whitespace", "no_messages", "blank_message"])
def test_empty_prompts(pipe, prompt):
    with pytest.raises(InvalidRequest):
        pipe.generate(prompt, max_new_tokens=5)
    with pytest.raises(InvalidRequest):
        list(pipe.stream(prompt, max_new_tokens=5))


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],
    [{"content": "hi"}],
    ["just a string"],
    [{"role": "user", "content": "hi"}, 42],
], ids=["no_content", "no_role", "string_message", "int_message"])
def test_malformed_messages(pipe, messages):
    with pytest.raises(InvalidRequest, match="message"):
        pipe.generate(messages, max_new_tokens=5)


def test_prompt_longer_than_context(pipe):
    context = pipe.target.context_length
    assert context == 2048
    too_long = (GOOD_PROMPT * 500)[:context]
    with pytest.raises(InvalidRequest, match="context"):
        pipe.generate(too_long, max_new_tokens=1)
    with pytest.raises(InvalidRequest, match="context"):
        pipe.generate("word " * 3000, max_new_tokens=1, chat_template=False)


def test_prompt_plus_new_tokens_beyond_context(pipe, tiny_mixed):
    prompt = (GOOD_PROMPT * 500)[:2000]
    with pytest.raises(InvalidRequest, match="48"):  # says how many new tokens still fit
        pipe.generate(prompt, max_new_tokens=49)
    # Exactly up to the context is allowed (draft trees may reach past it; RoPE does not mind).
    out = pipe.generate(prompt, max_new_tokens=48)
    assert out.token_ids == tiny_mixed.greedy_hf(prompt, 48)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5, "10", None])
def test_bad_max_new_tokens(pipe, max_new_tokens):
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        pipe.generate(GOOD_PROMPT, max_new_tokens=max_new_tokens)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        list(pipe.stream(GOOD_PROMPT, max_new_tokens=max_new_tokens))


@pytest.mark.parametrize("prompt", [[49152], [5, -1, 7], [10**12]], ids=["vocab_size", "negative", "huge"])
def test_token_ids_outside_the_vocabulary(pipe, prompt):
    with pytest.raises(InvalidRequest, match="token"):
        pipe.generate(prompt, max_new_tokens=3)


def test_sampling_request_with_greedy_verifier_is_refused(pipe):
    """A per-request temperature > 0 must not be silently decoded greedily."""
    with pytest.raises(SpecpipeError, match="temperature"):
        pipe.generate(GOOD_PROMPT, max_new_tokens=5, sampling=SamplingConfig(temperature=0.8))


def test_error_mid_stream_loses_nothing(pipe, tiny_mixed):
    """A consumer that stops reading a stream half-way leaves the pipeline usable."""
    stream = pipe.stream(GOOD_PROMPT, max_new_tokens=30)
    next(stream)
    stream.close()
    assert pipe.generate(GOOD_PROMPT, max_new_tokens=30).token_ids == tiny_mixed.greedy_hf(GOOD_PROMPT, 30)


# ---- the Python API ----------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie"])
def test_generate_result_is_consistent(tiny_mixed, pipeline):
    pipe = tiny_mixed.pipeline(pipeline)
    for prompt in random_prompts(6, seed=21):
        out = pipe.generate(prompt, max_new_tokens=25)
        assert out.prompt_ids == prompt
        assert out.stats.new_tokens == len(out.token_ids) == sum(out.stats.accept_lengths)
        assert out.stats.steps == len(out.stats.accept_lengths) >= 1
        assert out.text == tiny_mixed.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.stats.mean_accepted == pytest.approx(len(out.token_ids) / out.stats.steps)
        assert out.stats.seconds > 0 and out.stats.tokens_per_second > 0
        assert "prefill" in out.stats.stage_seconds
        assert str(out.stats.new_tokens) in out.stats.summary()
        if pipeline == "vanilla":
            assert set(out.stats.accept_lengths) == {1}


@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie"])
def test_stream_concatenates_to_generate(embedded, pipeline):
    pipe = embedded.pipeline(pipeline)
    prompt = "Write two short sentences about the sea."
    chunks = list(pipe.stream(prompt, max_new_tokens=24))
    assert all(isinstance(chunk, str) and chunk for chunk in chunks)
    assert len(chunks) > 1
    assert "".join(chunks) == pipe.generate(prompt, max_new_tokens=24).text


def test_stream_holds_back_split_characters(tiny):
    """Byte tokens that split a UTF-8 character are never streamed as replacement characters."""
    pipe = tiny.pipeline("vanilla")
    from specpipe.pipelines.pipeline import IncrementalText

    text = IncrementalText(pipe)
    ids = tiny.tokenizer("naïve café ☃ 日本", add_special_tokens=False)["input_ids"]
    out = "".join(text.push([token]) for token in ids) + text.flush()
    assert out == tiny.tokenizer.decode(ids) and "\ufffd" not in out


def test_interleaved_streams_are_independent(tiny_mixed):
    """Two streams of one pipeline consumed alternately each give their own greedy output."""
    pipe = tiny_mixed.pipeline("lookahead_trie")
    a, b = random_prompts(3, seed=31)[1:3]
    steps_a = pipe.steps(a, 30)
    steps_b = pipe.steps(b, 30)
    tokens_a, tokens_b = [], []
    done_a = done_b = False
    while not (done_a and done_b):
        if not done_a:
            step = next(steps_a, None)
            done_a = step is None or step.finished
            tokens_a += step.tokens if step else []
        if not done_b:
            step = next(steps_b, None)
            done_b = step is None or step.finished
            tokens_b += step.tokens if step else []
    assert tokens_a == tiny_mixed.greedy_hf(a, 30)
    assert tokens_b == tiny_mixed.greedy_hf(b, 30)


def test_multi_turn_messages(embedded):
    pipe = embedded.pipeline("prompt_lookup")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another one."},
    ]
    ids = pipe.encode(messages)
    expected_ids = embedded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    assert ids == list(expected_ids)
    assert "Blue." in embedded.tokenizer.decode(ids)
    out = pipe.generate(messages, max_new_tokens=12)
    assert out.token_ids == embedded.greedy_hf(ids, 12)
    assert out.prompt_ids == ids


def test_system_prompt_is_prepended(embedded):
    cfg = embedded.config("vanilla", "system_prompt=You are a pirate.")
    pipe = build_pipeline(cfg, loaded=embedded.loaded)
    ids = pipe.encode("Hello")
    assert "You are a pirate." in embedded.tokenizer.decode(ids)
    messages = [{"role": "system", "content": "Other."}, {"role": "user", "content": "Hello"}]
    assert "pirate" not in embedded.tokenizer.decode(pipe.encode(messages))


def test_chat_template_false(embedded):
    pipe = embedded.pipeline("vanilla")
    text = "Once upon a time"
    plain = pipe.encode(text, chat_template=False)
    assert plain == embedded.tokenizer(text)["input_ids"]
    assert plain != pipe.encode(text)
    out = pipe.generate(text, max_new_tokens=10, chat_template=False)
    assert out.prompt_ids == plain and out.token_ids == embedded.greedy_hf(plain, 10)
    cfg = embedded.config("vanilla", "chat_template=false")
    assert build_pipeline(cfg, loaded=embedded.loaded).encode(text) == plain


def test_token_id_prompts_skip_the_template(tiny_mixed):
    pipe = tiny_mixed.pipeline("prompt_lookup")
    out = pipe.generate(GOOD_PROMPT, max_new_tokens=8)
    assert out.prompt_ids == GOOD_PROMPT
    assert out.token_ids == tiny_mixed.greedy_hf(GOOD_PROMPT, 8)
    assert torch.tensor(out.token_ids).max() < tiny_mixed.loaded.model.config.vocab_size


@pytest.mark.parametrize("content", [b"{\"queries\": [1, 2], \"millis", b"\xff\xfe not json", b"{\"queries\": [1]}",
                                     b"{\"queries\": [4, 2], \"milliseconds\": [1.0, 2.0]}",
                                     # zeros divided by zero mid-answer; NaN and inf priced every tree out silently
                                     b"{\"queries\": [1, 2], \"milliseconds\": [0.0, 0.0]}",
                                     b"{\"queries\": [1, 2], \"milliseconds\": [-3.0, 2.0]}",
                                     b"{\"queries\": [1, 2], \"milliseconds\": [NaN, 2.0]}",
                                     b"{\"queries\": [1, 2], \"milliseconds\": [1.0, Infinity]}",
                                     b"{\"queries\": [0, 2], \"milliseconds\": [1.0, 2.0]}"])
def test_an_unreadable_cost_curve_cache_is_measured_again_with_a_warning(tiny, tmp_path, content, caplog,
                                                                         monkeypatch):
    import logging

    from specpipe.cost import CostCurve, OtherProcessesLoad, cached_cost_curve, cost_curve_path

    # cached even when measured on a busy machine
    monkeypatch.setattr(OtherProcessesLoad, "competed", lambda self, threads=None: False)
    target = tiny.pipeline("vanilla").target
    path = cost_curve_path(target, kv_length=8, cache_dir=tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        curve = cached_cost_curve(target, kv_length=8, cache_dir=tmp_path)
    assert isinstance(curve, CostCurve) and len(curve.queries) > 1 and min(curve.milliseconds) > 0
    assert "cannot be read" in caplog.text and "measuring it again" in caplog.text
    assert cached_cost_curve(target, kv_length=8, cache_dir=tmp_path) == curve  # the fresh curve replaced it


@pytest.mark.parametrize("overrides,match", [
    (["task=distill_corpus", "distill.limit=-1"], "distill.limit must be >= 1"),  # was: every prompt but one
    (["task=distill_corpus", "distill.token_budget=-1"], "distill.token_budget must be >= 1"),
    (["task=distill_corpus", "distill.seed=abc"], "distill.seed must be a number"),
    (["task=calibrate_tree", "pipeline=medusa", "calibrate_tree.answers=-1"], "calibrate_tree.answers must be >= 0"),
    (["task=calibrate_tree", "pipeline=medusa", "calibrate_tree.eval_fraction=1.5"],
     r"calibrate_tree.eval_fraction must be in \(0, 1\]"),
    (["task=search_layers", "search_layers.eval_fraction=0"], r"search_layers.eval_fraction must be in \(0, 1\]"),
])
def test_bad_task_settings_are_refused_before_any_work(overrides, match):
    from specpipe.tasks import run_task

    with pytest.raises(ConfigError, match=match):
        run_task(compose_config(["model=tiny_random", *overrides]))


@pytest.mark.parametrize("task", ["calibrate_tree", "search_layers", "distill_corpus", "distill_draft"])
def test_an_output_file_that_is_a_folder_is_refused_before_any_work(tmp_path, task):
    """A QA pass met IsADirectoryError at the very end of these tasks (after scoring every held-out answer,
    or the whole search): `out` is checked before the first long pass, and the folder is left as it was."""
    from conftest import medusa_head_dir
    from test_distill_draft import write_corpus

    from specpipe.tasks import run_task

    suffix = ".safetensors" if task == "distill_draft" else ""  # the draft's file is refused without it
    corpus, folder = tmp_path / "corpus" / "corpus.parquet", tmp_path / f"a_folder{suffix}"
    corpus.parent.mkdir()
    write_corpus(corpus)
    folder.mkdir()
    (folder / "kept.txt").write_text("mine")
    tiny_config = load_model(compose_config(["model=tiny_random"]).model).model.config
    overrides = {
        "calibrate_tree": ["pipeline=medusa", f"calibrate_tree.corpus={corpus}", "calibrate_tree.progress=false",
                           f"pipeline.drafters.medusa.path={medusa_head_dir(tiny_config, 'random')}",
                           "pipeline.drafters.medusa.vocab_top_k=0"],
        "search_layers": [f"search_layers.corpus={corpus}", "search_layers.progress=false"],
        "distill_corpus": ["distill.limit=2", f"distill.shards={tmp_path / 'shards'}", "distill.progress=false"],
        "distill_draft": [f"distill_draft.corpus={corpus}", "distill_draft.layers=[1]",
                          f"distill_draft.checkpoint_dir={tmp_path / 'ck'}", "distill_draft.progress=false"],
    }[task]
    option = "distill.out" if task == "distill_corpus" else f"{task}.out"
    with pytest.raises(ConfigError, match=rf"{option}=.*a_folder{suffix} is a folder: give a file, e.g. {option}=.*a_folder{suffix}/"):
        run_task(compose_config([f"task={task}", "model=tiny_random", *overrides, f"{option}={folder}"]))
    assert sorted(p.name for p in folder.iterdir()) == ["kept.txt"]
    assert not (tmp_path / "ck").exists() and not (tmp_path / "shards").exists()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"{option}=.*a_file/x{suffix}: .*a_file is a file, not a folder"):
        run_task(compose_config([f"task={task}", "model=tiny_random", *overrides,
                                 f"{option}={tmp_path / 'a_file' / ('x' + suffix)}"]))
