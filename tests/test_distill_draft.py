"""The distilled draft LM (specpipe.distill.draft_model, task=distill_draft): a draft built from target
layers computes exactly those layers around the target's shared embedding and LM head, its file
round-trips (bf16 layers), a draft of another target or a missing file is refused with a message,
the eval's batched chains equal one-at-a-time greedy drafting, and the task trains, checkpoints,
resumes and exports on the tiny model."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specpipe.distill.corpus import Answer, BatchedGreedy, ShardFolder, chat_prompt_ids, merge_shards
from specpipe.distill.draft_model import build_draft, grow_draft, load_draft, save_draft
from specpipe.distill.prompts import ChatPrompt, prompt_id
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import compose_config, load_model
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.tasks.distill_draft import run_distill_draft
from specpipe.training.draft import TeacherCache, compute_teacher, draft_chains, evaluate
from specpipe.training.examples import Example

PROMPT_TEXTS = ["Hi.", "Name a colour.", "What is 2 + 2?", "List three rivers in Europe.",
                "Write a haiku about tea.", "Why is the sky blue?", "Give me a word that rhymes with cat.",
                "Explain recursion in one sentence.", "What is the capital of France?", "Count to five.",
                "Describe a cat.", "Say something kind.", "Translate 'hello' to German.", "Tell me a joke."]


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def metadata_for(model) -> dict:
    return {"base_model": "tiny_random", "tokenizer": tokenizer_fingerprint(model.tokenizer),
            "command": "python run.py task=distill_draft model=tiny_random", "training": {"steps": 0}}


@pytest.fixture()
def target(tiny_mixed):
    """The context-dependent tiny model's stock-attention instance (its output depends on the context)."""
    return tiny_mixed.reference


def test_build_draft_shares_the_head_and_copies_the_layers(tiny_mixed, target):
    ids = chat_prompt_ids(tiny_mixed.tokenizer, "What does a draft model do?")
    draft = build_draft(target, [0, 1])  # every target layer: the draft IS the target
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert draft.lm_head.weight is target.lm_head.weight and draft.model.norm.weight is target.model.norm.weight
    shared = [draft.model.embed_tokens.weight, draft.model.norm.weight, draft.lm_head.weight]
    assert not any(p.requires_grad for p in shared)
    own = list(draft.model.layers.parameters())
    assert own and all(p.requires_grad for p in own)
    assert not {p.data_ptr() for p in own} & {p.data_ptr() for p in target.model.layers.parameters()}
    assert torch.equal(logits(draft, ids), logits(target, ids))

    # A draft of one layer equals the target cut to that layer (an independent path: the target's
    # own module list, shortened).
    draft = build_draft(target, [1])
    cut = copy.deepcopy(target)
    cut.model.layers = torch.nn.ModuleList([cut.model.layers[1]])
    cut.config.num_hidden_layers = 1
    torch.testing.assert_close(logits(draft, ids), logits(cut, ids), rtol=0, atol=1e-5)
    # Training the draft's layers leaves the target's untouched (copies, not views).
    before = target.model.layers[1].mlp.down_proj.weight.clone()
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight.add_(1.0)
    assert torch.equal(target.model.layers[1].mlp.down_proj.weight, before)


def test_build_draft_refuses_bad_layers_and_non_llama_targets(target):
    with pytest.raises(ConfigError, match=r"out of range.*2 layers"):
        build_draft(target, [0, 2])
    with pytest.raises(ConfigError, match="empty"):
        build_draft(target, [])
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ConfigError, match="Llama"):
        build_draft(gpt2, [0])


def test_save_load_round_trip(tiny_mixed, target, tmp_path):
    ids = chat_prompt_ids(tiny_mixed.tokenizer, "Round trip, please.")
    draft = build_draft(target, [1, 0])
    path = tmp_path / "draft" / "tiny.safetensors"
    sidecar = save_draft(draft, path, {**metadata_for(tiny_mixed), "eval": {"acceptance_per_depth": {"1": 0.5}}})
    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
        assert all(key.startswith("model.layers.") for key in keys)
        assert {handle.get_tensor(key).dtype for key in keys} == {torch.bfloat16}
    assert len(keys) == len(draft.model.layers.state_dict())
    on_disk = json.loads(path.with_suffix(".json").read_text())
    assert on_disk == sidecar
    assert on_disk["num_layers"] == 2 and on_disk["target_layers"] == [1, 0] and on_disk["hidden_size"] == 64
    assert on_disk["vocab_size"] == 49152 and on_disk["tokenizer"] == tokenizer_fingerprint(tiny_mixed.tokenizer)
    assert on_disk["command"].startswith("python run.py task=distill_draft") and on_disk["format_version"] == 1
    assert not list(path.parent.glob(".tmp-*"))

    loaded = load_draft(target, tiny_mixed.tokenizer, path)
    assert loaded.lm_head.weight is target.lm_head.weight and loaded.model.embed_tokens is target.model.embed_tokens
    assert not loaded.training and loaded.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    rounded = build_draft(target, [1, 0])
    with torch.no_grad():
        for parameter in rounded.model.layers.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    assert torch.equal(logits(loaded, ids), logits(rounded, ids))
    torch.testing.assert_close(logits(loaded, ids), logits(draft, ids), rtol=0, atol=0.1)


def test_a_grown_draft_starts_as_the_trained_one_and_its_new_layers_train(tiny_mixed, target, tmp_path):
    """init_from: the trained draft's layers keep their weights, the new ones start adding nothing to the
    residual stream (so the grown draft's logits are the trained draft's, bit for bit) and do train."""
    ids = chat_prompt_ids(tiny_mixed.tokenizer, "Grow the draft, please.")
    trained = build_draft(target, [1])
    with torch.no_grad():  # weights unlike any target layer's, exact in bf16 (the file's dtype)
        for parameter in trained.model.layers.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter)).copy_(parameter.to(torch.bfloat16).float())
    path = tmp_path / "trained.safetensors"
    save_draft(trained, path, metadata_for(tiny_mixed))

    grown = grow_draft(target, tiny_mixed.tokenizer, path, [0, 1, 1])
    assert len(grown.model.layers) == 3 and grown.target_layers == [0, 1, 1]
    assert grown.grown_from == {"file": str(path), "target_layers": [1], "positions": [1]}
    assert torch.equal(grown.model.layers[1].mlp.up_proj.weight, trained.model.layers[0].mlp.up_proj.weight)
    for new in (0, 2):  # copies of target layers whose residual outputs are zero
        layer = grown.model.layers[new]
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert torch.equal(layer.self_attn.q_proj.weight, target.model.layers[[0, 1, 1][new]].self_attn.q_proj.weight)
    assert torch.equal(logits(grown, ids), logits(trained, ids))
    assert not torch.equal(logits(build_draft(target, [0, 1, 1]), ids), logits(trained, ids))

    # The new layers learn: a few steps towards other logits move their zeroed outputs and change the logits.
    optimizer = torch.optim.AdamW(grown.model.layers.parameters(), lr=1e-2)
    goal = logits(target, ids).softmax(-1)
    for _ in range(3):
        grown.train()
        out = grown(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        loss = -(goal * out.log_softmax(-1)).sum(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert grown.model.layers[0].mlp.down_proj.weight.any() and grown.model.layers[2].self_attn.o_proj.weight.any()
    assert not torch.equal(logits(grown.eval(), ids), logits(trained, ids))

    with pytest.raises(ConfigError, match=r"trained from target layers \[1\], which are not a subsequence of "
                                          r"distill_draft.layers=\[0\]"):
        grow_draft(target, tiny_mixed.tokenizer, path, [0])
    with pytest.raises(ConfigError, match=r"no draft model at .*missing.safetensors"):
        grow_draft(target, tiny_mixed.tokenizer, tmp_path / "missing.safetensors", [0, 1])


def test_load_refuses_another_target_and_names_the_build_command(tiny_mixed, target, tmp_path):
    path = tmp_path / "tiny.safetensors"
    missing = tmp_path / "nowhere" / "draft.safetensors"
    with pytest.raises(ConfigError, match=r"nowhere.*python run.py task=distill_draft"):
        load_draft(target, tiny_mixed.tokenizer, missing)
    save_draft(build_draft(target, [0]), path, metadata_for(tiny_mixed))
    original = json.loads(path.with_suffix(".json").read_text())

    def refused(change: dict, match: str) -> None:
        path.with_suffix(".json").write_text(json.dumps({**original, **change}))
        with pytest.raises(ConfigError, match=match):
            load_draft(target, tiny_mixed.tokenizer, path)

    refused({"hidden_size": 576}, r"hidden_size 576 \(draft\) vs 64 \(target\)")
    refused({"vocab_size": 1000}, r"vocab_size 1000 \(draft\) vs 49152")
    refused({"tokenizer": {**original["tokenizer"], "vocab_sha256": "0" * 32}}, "tokenizer")
    refused({"num_layers": 2}, r"holds layers \[0\].*2 layer")
    refused({"format_version": 99}, "rebuild")
    path.with_suffix(".json").unlink()
    with pytest.raises(ConfigError, match="sidecar"):
        load_draft(target, tiny_mixed.tokenizer, path)
    # A real target of another size: the same refusal, from its own config.
    other = load_model(compose_config(["model=tiny_random", "model.hidden_size=32"]).model)
    path.with_suffix(".json").write_text(json.dumps(original))
    with pytest.raises(ConfigError, match="hidden_size 64 \\(draft\\) vs 32"):
        load_draft(other.model, other.tokenizer, path)


def test_batched_chains_equal_one_at_a_time_greedy(tiny_mixed, target):
    draft = build_draft(target, [1])
    rng = np.random.default_rng(0)
    contexts = [rng.integers(300, 1300, size=n) for n in (3, 17, 1, 9, 30)]
    batched = draft_chains(draft, contexts, depth=4, pad_id=tiny_mixed.tokenizer.pad_token_id)
    for context, chain in zip(contexts, batched):
        single = draft_chains(draft, [context], depth=4, pad_id=0)[0]
        tokens = list(context)
        for _ in range(4):  # full recompute, no cache, no padding
            tokens.append(int(logits(draft, tokens)[-1].argmax()))
        assert chain.tolist() == single.tolist() == tokens[len(context):]


def test_eval_of_the_target_itself_accepts_everything(tiny_mixed, target, tmp_path):
    """A draft of every target layer drafts the target's own greedy answers: top-1 agreement and
    acceptance at every depth are 1 (the eval counts what it should)."""
    from omegaconf import OmegaConf

    tokenizer = tiny_mixed.tokenizer
    examples = []
    for text in PROMPT_TEXTS[:6]:
        prompt = chat_prompt_ids(tokenizer, text)
        answer = tiny_mixed.greedy_loop(prompt, 12, eos_token_ids=[])
        tokens = np.asarray((prompt + answer)[:-1], np.int64)
        examples.append(Example(prompt_id(text), tokens, len(prompt), np.asarray(answer, np.int64), len(answer)))
    cache = TeacherCache(tmp_path / "teacher")
    compute_teacher(target, examples, cache, top_k=8, batch_tokens=64, pad_id=tokenizer.pad_token_id, progress=False)
    teacher = cache.load()
    assert all(len(teacher[e.prompt_id][0]) == e.n_pred for e in examples)
    cfg = OmegaConf.create({"batch": 128, "loss_chunk": 16, "chain_depth": 5, "seed": 0, "eval_chains": 20,
                            "eval_batch": 3})
    result = evaluate(build_draft(target, [0, 1]), examples, teacher, cfg, tokenizer.pad_token_id, progress=False)
    assert result["top1_teacher"] == 1.0 and result["top1_corpus"] == 1.0 and result["chains"] == 20
    assert result["acceptance_per_depth"] == {str(d): 1.0 for d in range(1, 6)}
    assert result["mean_accepted_per_chain"] == 5.0
    one_layer = evaluate(build_draft(target, [1]), examples, teacher, cfg, tokenizer.pad_token_id, progress=False)
    depths = list(one_layer["acceptance_per_depth"].values())
    # The KL of the target to itself is the floor -log(teacher top-k mass) (p is renormalized over the top-k).
    assert depths == sorted(depths, reverse=True) and one_layer["kl"] > result["kl"] + 0.01


def write_corpus(path: Path) -> None:
    """A corpus in the shipped format (ShardFolder + merge_shards): the stock tiny model's greedy answers."""
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    generator = BatchedGreedy(loaded.model, loaded.tokenizer, max_new_tokens=16)
    prompts = [ChatPrompt(prompt_id(text), "writing", "test", text) for text in PROMPT_TEXTS]
    shards = ShardFolder(path.parent / "shards")
    answers = generator.answer(prompts)
    shards.write([Answer(a.prompt, a.answer_ids or [1], a.answer, a.finished) for a in answers])
    merge_shards(shards, path, prompts, {"model": "tiny_random", "system_prompt": None,
                                         "tokenizer": tokenizer_fingerprint(loaded.tokenizer)})


def test_examples_carry_a_second_turns_history(tmp_path):
    """A follow-up's example starts with the whole conversation before its answer; a corpus made
    before the history column existed reads as first turns."""
    import pyarrow.parquet as pq

    from specpipe.distill.prompts import follow_up_prompts
    from specpipe.training.examples import load_examples

    loaded = load_model(compose_config(["model=tiny_random"]).model)
    tokenizer = loaded.tokenizer
    first = ChatPrompt(prompt_id(PROMPT_TEXTS[0]), "writing", "test", PROMPT_TEXTS[0])
    second = follow_up_prompts([(first, "an earlier answer")])[0]
    shards = ShardFolder(tmp_path / "shards")
    shards.write([Answer(first, [5, 6, 7], "x", False), Answer(second, [8, 9], "y", False)])
    path = tmp_path / "corpus.parquet"
    merge_shards(shards, path, [first, second], {"model": "tiny_random"})
    examples = {e.prompt_id: e for e in load_examples(path, tokenizer, 512, None)}
    prompt = chat_prompt_ids(tokenizer, second.text, None, second.history)
    assert examples[second.prompt_id].tokens.tolist() == prompt + [8]
    assert examples[first.prompt_id].tokens.tolist() == chat_prompt_ids(tokenizer, first.text) + [5, 6]
    # Both turns of a conversation fall on one side of the held-out split.
    assert examples[second.prompt_id].split_id == examples[first.prompt_id].split_id == first.prompt_id
    old = tmp_path / "old.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["history"]), old)
    assert load_examples(old, tokenizer, 512, None)[1].tokens.tolist() == chat_prompt_ids(tokenizer, second.text) + [8]


def assert_pins_the_corpus_ranking(path: Path, corpus: Path) -> None:
    """The exported ranking of draft tokens counts the training corpus's answer tokens."""
    import pyarrow.parquet as pq

    answers = pq.read_table(corpus, columns=["answer_ids"]).column("answer_ids").combine_chunks().values.to_numpy()
    with np.load(path, allow_pickle=False) as pinned:
        assert pinned["counts"].tolist() == np.bincount(answers, minlength=len(pinned["counts"])).tolist()


def test_distill_task_trains_resumes_and_exports(tmp_path, capsys):
    from specpipe.tasks import TASKS

    assert TASKS["distill_draft"] == ("specpipe.tasks.distill_draft", "run_distill_draft")
    corpus, out, checkpoints = tmp_path / "corpus.parquet", tmp_path / "out" / "draft.safetensors", tmp_path / "ck"
    write_corpus(corpus)

    def config(steps: int):
        return compose_config(overrides(steps))

    def overrides(steps: int) -> list[str]:
        return ["task=distill_draft", "model=tiny_random", f"distill_draft.corpus={corpus}",
                f"distill_draft.checkpoint_dir={checkpoints}", f"distill_draft.out={out}",
                "distill_draft.layers=[1]", f"distill_draft.steps={steps}", "distill_draft.lr=0.01",
                "distill_draft.warmup=0", "distill_draft.batch=96", "distill_draft.checkpoint_every=2",
                "distill_draft.eval_every=0", "distill_draft.eval_fraction=0.3",
                "distill_draft.teacher_top_k=8", "distill_draft.eval_chains=10",
                "distill_draft.progress=false"]

    with pytest.raises(ConfigError, match=r"no corpus at .*nothing.parquet: .* or set distill_draft.corpus"):
        run_distill_draft(compose_config(["task=distill_draft", "model=tiny_random", "distill_draft.layers=[1]",
                                          f"distill_draft.corpus={tmp_path / 'nothing.parquet'}"]))
    first = run_distill_draft(config(6))
    assert first["step"] == 6
    losses = [entry["loss"] for entry in first["train_log"]]
    assert [entry["step"] for entry in first["train_log"]] == [2, 4, 6] and losses[-1] < losses[0]
    assert sorted(p.name for p in (checkpoints / "train-layers-1").glob("checkpoint-*.pt")) == \
        ["checkpoint-000004.pt", "checkpoint-000006.pt"]
    teacher_shards = sorted((checkpoints / "teacher").glob("*.npy"))
    assert teacher_shards

    from specpipe.training.resumable import lock_folder

    held = lock_folder(checkpoints, "distill_draft")  # another run using the folder: refused, nothing written
    with pytest.raises(ConfigError, match=r"another task=distill_draft run \(pid \d+\)"):
        run_distill_draft(config(8))
    held.close()

    second = run_distill_draft(config(8))  # resumes at step 6: two more steps, the teacher is not recomputed
    assert second["step"] == 8 and [entry["step"] for entry in second["train_log"]] == [2, 4, 6, 8]
    assert sorted((checkpoints / "teacher").glob("*.npy")) == teacher_shards
    report = json.loads(Path(second["report"]).read_text())
    assert [r["step"] for r in report["evals"]] == [0, 6, 8]  # the initialised draft, then each finished run
    for result in report["evals"]:
        assert set(result["acceptance_per_depth"]) == {"1", "2", "3", "4", "5"}
        assert 0.0 <= result["top1_teacher"] <= 1.0 and result["chains"] > 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["training"]["steps"] == 8 and sidecar["target_layers"] == [1]
    assert sidecar["eval"]["acceptance_per_depth"] == report["evals"][-1]["acceptance_per_depth"]
    assert sidecar["command"].startswith("python run.py task=distill_draft")
    assert_pins_the_corpus_ranking(out.with_suffix(".vocab.npz"), corpus)
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    draft = load_draft(loaded.model, loaded.tokenizer, out)
    assert len(draft.model.layers) == 1
    capsys.readouterr()
    assert run_distill_draft(config(8))["step"] == 8  # a rerun after the end says so
    assert "nothing left to train: the checkpoint is at step 8 and distill_draft.steps=8" in capsys.readouterr().err

    # Growing the exported draft by a layer: its own folder, the source recorded, the source never overwritten.
    grown_out = tmp_path / "out" / "grown.safetensors"
    grow = [*overrides(2), f"distill_draft.init_from={out}", "distill_draft.layers=[0,1]"]
    with pytest.raises(ConfigError, match=r"distill_draft.out is distill_draft.init_from .*would overwrite"):
        run_distill_draft(compose_config(grow))
    grown = run_distill_draft(compose_config([*grow, f"distill_draft.out={grown_out}"]))
    assert grown["step"] == 2 and Path(grown["report"]).parent.name.startswith("train-layers-0-1-from-")
    sidecar = json.loads(grown_out.with_suffix(".json").read_text())
    assert sidecar["target_layers"] == [0, 1] and sidecar["init_from"]["target_layers"] == [1]
    from specpipe.stores.manifest import sha256_file

    assert sidecar["init_from"]["sha256"] == sha256_file(out)
    assert Path(grown["report"]).parent.name == f"train-layers-0-1-from-{sha256_file(out)[:12]}"
    assert sidecar["init_from"]["file"] == str(out) and len(load_draft(loaded.model, loaded.tokenizer,
                                                                       grown_out).model.layers) == 2


def test_a_corpus_of_another_tokenizer_is_refused(tmp_path):
    """Every task that reads the corpus (distill_draft, train_heads, search_layers, calibrate_tree) reads it
    through read_task_corpus: the tokenizer it records is checked (a corpus that records none is taken),
    the system prompt it was generated under wins over the config's, and a missing corpus names the
    task's own option."""
    import pyarrow.parquet as pq

    from specpipe.distill.corpus import METADATA_KEY, read_corpus_metadata
    from specpipe.training.examples import read_task_corpus

    loaded = load_model(compose_config(["model=tiny_random"]).model)
    vocab_sha256 = tokenizer_fingerprint(loaded.tokenizer)["vocab_sha256"]
    corpus = tmp_path / "corpus.parquet"
    write_corpus(corpus)
    examples, system_prompt = read_task_corpus(corpus, "x.corpus", loaded.tokenizer, vocab_sha256, "m", 512, "ignored")
    assert len(examples) == len(PROMPT_TEXTS) and system_prompt is None  # the corpus records None

    table = pq.read_table(corpus)
    recorded = read_corpus_metadata(corpus)

    def record(**fields) -> None:  # the corpus again, its metadata changed
        document = json.dumps({**recorded, **fields}).encode()
        pq.write_table(table.replace_schema_metadata({**table.schema.metadata, METADATA_KEY: document}), corpus)

    record(system_prompt="Be brief.")
    assert read_task_corpus(corpus, "x.corpus", loaded.tokenizer, vocab_sha256, "m", 512, "from config")[1] == "Be brief."
    record(tokenizer={})  # an older corpus: no tokenizer recorded, taken as it is
    assert len(read_task_corpus(corpus, "x.corpus", loaded.tokenizer, vocab_sha256, "m", 512, None)[0]) == len(examples)
    record(tokenizer={"vocab_sha256": "another"})
    with pytest.raises(ConfigError, match=r"holds token ids of another tokenizer than model=m's"):
        read_task_corpus(corpus, "x.corpus", loaded.tokenizer, vocab_sha256, "m", 512, None)
    with pytest.raises(ConfigError, match=r"no corpus at .*nothing.parquet: build it with `python run.py "
                                          r"task=distill_corpus`, or set x.corpus"):
        read_task_corpus(tmp_path / "nothing.parquet", "x.corpus", loaded.tokenizer, vocab_sha256, "m", 512, None)


@pytest.mark.parametrize("override,match", [
    ("distill_draft.teacher_top_k=0", "distill_draft.teacher_top_k must be >= 1"),
    ("distill_draft.teacher_top_k=100000", "teacher_top_k must be at most the vocabulary size 49152"),
    ("distill_draft.loss_chunk=0", "distill_draft.loss_chunk must be >= 1"),
    ("distill_draft.eval_batch=0", "distill_draft.eval_batch must be >= 1"),
    ("distill_draft.lr=-1", "distill_draft.lr must be > 0"),
    ("distill_draft.out=/tmp/no_suffix_draft", r"one \.safetensors file .*no_suffix_draft\.safetensors"),
])
def test_bad_distillation_settings_are_refused_before_the_teacher_pass(tmp_path, override, match):
    """A QA pass met teacher_top_k=0 failing after a whole (empty) teacher pass, a draft exported without the
    suffix drafter.path reads it by, and raw tracebacks for the rest."""
    with pytest.raises(ConfigError, match=match):
        run_distill_draft(compose_config(["task=distill_draft", "model=tiny_random", "distill_draft.layers=[0]",
                                          f"distill_draft.checkpoint_dir={tmp_path / 'ck'}", override]))
    assert not (tmp_path / "ck").exists()


def test_the_loss_head_runs_onednn_with_torchs_products_and_gradient():
    """frozen_loss_head: a frozen fp32 output layer's product and its gradient to the input equal
    torch's (float rounding apart); a layer that trains, has a bias or is bf16 stays as it is."""
    from specpipe.training.resumable import FrozenPackedLinear, frozen_loss_head
    from specpipe.engine.cpu import onednn_available

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 300, bias=False)
    linear.requires_grad_(False)
    head = frozen_loss_head(linear)
    if not onednn_available():
        assert head is linear
        pytest.skip("no oneDNN in this torch build")
    assert isinstance(head, FrozenPackedLinear)
    rows = torch.randn(37, 48)
    weights = torch.randn(37, 300)
    grads = []
    for module in (linear, head):
        x = rows.clone().requires_grad_(True)
        out = module(x)
        (out * weights).sum().backward()
        grads.append((out.detach(), x.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)
    assert linear.weight.grad is None
    trained = torch.nn.Linear(48, 300, bias=False)
    assert frozen_loss_head(trained) is trained
    with_bias = torch.nn.Linear(48, 300).requires_grad_(False)
    assert frozen_loss_head(with_bias) is with_bias
    bf16 = torch.nn.Linear(48, 300, bias=False).to(torch.bfloat16).requires_grad_(False)
    assert frozen_loss_head(bf16) is bf16
