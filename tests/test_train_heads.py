"""task=train_heads (EAGLE): the training rows pair each feature with the next token, the eval of a
head that predicts the target's features exactly accepts everything, and the task trains (loss
falls), checkpoints, resumes and exports a head the pipeline loads (CI runs only a few steps on the
tiny model; the real training is the documented command)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specpipe.training.resumable import frozen_product
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model
from specpipe.tasks.train_heads import run_train_heads
from specpipe.training.examples import Example
from specpipe.training.heads import HeadBatch
from test_distill_draft import assert_pins_the_corpus_ranking, write_corpus


def assert_greedy(pipe) -> None:
    """The pipeline's output equals HF greedy on a fresh instance of the tiny model."""
    reference = load_model(compose_config(["model=tiny_random"]).model)
    prompt = [400, 401, 402, 403] * 3
    with torch.inference_mode():
        expected = reference.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                            eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    assert pipe.generate(prompt, max_new_tokens=10, chat_template=False).token_ids == expected


def test_training_rows_pair_each_feature_with_the_next_token():
    """Row p reads (f_p, s_{p+1}) and is scored on f_{p+1} and s_{p+2}, only where s_{p+2} is an answer token."""
    prompt, answer = [10, 11, 12], [20, 21, 22, 23]
    tokens = np.asarray((prompt + answer)[:-1], np.int64)  # 6 input positions
    example = Example("a", tokens, len(prompt), np.asarray(answer, np.int64), len(tokens) - len(prompt) + 1)
    features = {"a": np.arange(len(tokens) * 2, dtype=np.float32).reshape(len(tokens), 2)}  # f_p = [2p, 2p + 1]
    batch = HeadBatch([example], features, pad_id=0)
    assert batch.tokens[0].tolist() == [11, 12, 20, 21, 22]  # s_{p+1}, p = 0..4
    assert batch.features[0, :, 0].tolist() == [0, 2, 4, 6, 8]  # f_p
    assert batch.next_features[0, :, 0].tolist() == [2, 4, 6, 8, 10]  # f_{p+1}
    assert batch.labels[0].tolist() == [-1, 20, 21, 22, 23]  # s_{p+2} where it is an answer token
    mask = batch.attention_mask()[0, 0]
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


def test_train_heads_trains_resumes_and_exports(tmp_path, capsys):
    from specpipe.tasks import TASKS

    assert TASKS["train_heads"] == ("specpipe.tasks.train_heads", "run_train_heads")
    corpus, out, checkpoints = tmp_path / "corpus.parquet", tmp_path / "head", tmp_path / "ck"
    write_corpus(corpus)

    def config(steps: int, *extra: str):
        return compose_config(["task=train_heads", "model=tiny_random", f"train_heads.corpus={corpus}",
                               f"train_heads.checkpoint_dir={checkpoints}", f"train_heads.out={out}",
                               f"train_heads.steps={steps}", "train_heads.lr=0.003", "train_heads.warmup=0",
                               "train_heads.batch=128", "train_heads.checkpoint_every=2", "train_heads.eval_every=0",
                               "train_heads.eval_fraction=0.3", "train_heads.vocab_top_k=2000",
                               "train_heads.eval_chains=8", "train_heads.progress=false", *extra])

    first = run_train_heads(config(6))
    assert first["step"] == 6
    losses = [entry["loss"] for entry in first["train_log"]]
    assert [entry["step"] for entry in first["train_log"]] == [2, 4, 6] and losses[-1] < losses[0]
    assert sorted(p.name for p in (checkpoints / "eagle-fp32").glob("checkpoint-*.pt")) == \
        ["checkpoint-000004.pt", "checkpoint-000006.pt"]
    feature_shards = sorted((checkpoints / "features-fp32").glob("*.npy"))
    assert feature_shards
    with pytest.raises(ConfigError, match="train_heads.kind"):
        run_train_heads(config(8, "train_heads.kind=bogus"))
    with pytest.raises(ConfigError, match=r"no corpus at .*nothing.parquet: .* or set train_heads.corpus"):
        run_train_heads(config(8, f"train_heads.corpus={tmp_path / 'nothing.parquet'}"))

    capsys.readouterr()
    second = run_train_heads(config(8))  # resumes at step 6; the features are not extracted again
    assert "nothing left to train" not in capsys.readouterr().err
    assert second["step"] == 8 and [entry["step"] for entry in second["train_log"]] == [2, 4, 6, 8]
    assert sorted((checkpoints / "features-fp32").glob("*.npy")) == feature_shards
    report = json.loads(Path(second["report"]).read_text())
    assert [r["step"] for r in report["evals"]] == [0, 6, 8]
    for result in report["evals"]:
        assert set(result["acceptance_per_depth"]) == {"1", "2", "3", "4", "5"} and result["chains"] > 0
        assert 0.0 <= result["top1"] <= 1.0 and 0.0 <= result["vocab_miss_rate"] <= 1.0
    exported = json.loads((out / "config.json").read_text())["specpipe"]
    assert exported["training"]["steps"] == 8 and exported["command"].startswith("python run.py task=train_heads")
    # what defines the data and the run is in the sidecar, not only in the command (whose defaults may change)
    settings = config(8).train_heads
    assert [exported["training"][key] for key in ("max_seq_len", "vocab_top_k", "seed")] == \
        [settings.max_seq_len, 2000, settings.seed]
    assert exported["eval"]["acceptance_per_depth"] == report["evals"][-1]["acceptance_per_depth"]
    assert_pins_the_corpus_ranking(out / "draft_vocab.npz", corpus)
    # a rerun after the end said only "resumed from step 8"
    assert run_train_heads(config(8))["step"] == 8
    assert "nothing left to train: the checkpoint is at step 8 and train_heads.steps=8 (raise train_heads.steps" \
        in capsys.readouterr().err

    loaded = load_model(compose_config(["model=tiny_random"]).model)
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=eagle", "cost_curve=flat",
                                          f"pipeline.drafters.eagle.path={out}", "pipeline.drafters.eagle.vocab_top_k=0"]),
                          loaded=loaded)
    assert_greedy(pipe)

    # eval_of: the exported head scored again on this split, nothing trained. Its loss is the exported
    # eval's up to the bf16 export's rounding, far from the untrained head's (step 0).
    checkpoint_files = sorted((checkpoints / "eagle-fp32").iterdir())
    report_text = Path(second["report"]).read_text()
    scored = run_train_heads(config(8, f"train_heads.eval_of={out}"))["eval"]
    trained, untrained = report["evals"][-1], report["evals"][0]
    assert (scored["positions"], scored["chains"]) == (trained["positions"], trained["chains"])
    assert scored["loss"] == pytest.approx(trained["loss"], rel=0.02)
    assert abs(untrained["loss"] - trained["loss"]) > 0.1 * trained["loss"]
    assert sorted((checkpoints / "eagle-fp32").iterdir()) == checkpoint_files
    # a run's checkpoints do not pin eval_of: those written before the option existed still resume
    saved = torch.load(checkpoint_files[0], weights_only=True)["settings"]
    assert "eval_of" not in saved and "lr" in saved
    assert Path(second["report"]).read_text() == report_text
    with pytest.raises(ConfigError, match=r"train_heads.eval_of=.*nowhere is not a directory"):
        run_train_heads(config(8, f"train_heads.eval_of={tmp_path / 'nowhere'}"))
    with pytest.raises(ConfigError, match=r"train_heads.eval_of.*EAGLE-1"):  # the layout, named
        run_train_heads(config(8, "train_heads.kind=eagle3", f"train_heads.eval_of={out}"))
    with pytest.raises(ConfigError, match=r"eval_of evaluates a trained head and trains nothing"):
        run_train_heads(config(8, f"train_heads.eval_of={out}", f"train_heads.init_from={out}"))


@pytest.mark.parametrize("override,match", [
    ("train_heads.steps=-3", "train_heads.steps must be >= 0"),
    ("train_heads.batch=0", "train_heads.batch must be >= 1"),
    ("train_heads.lr=-1", "train_heads.lr must be > 0"),
    ("train_heads.checkpoint_every=0", "train_heads.checkpoint_every must be >= 1"),
    ("train_heads.eval_fraction=1.5", "train_heads.eval_fraction must be between 0 and 1"),
    ("train_heads.limit=-1", "train_heads.limit must be >= 1"),
    ("train_heads.eval_chains=0", "train_heads.eval_chains must be >= 1"),
    ("train_heads.feature_batch=0", "train_heads.feature_batch must be >= 1"),
    ("train_heads.medusa_heads=0", "train_heads.medusa_heads must be >= 1"),
    ("train_heads.eagle_layers=0", "train_heads.eagle_layers must be >= 1"),
    ("train_heads.eagle_layers=2 train_heads.kind=medusa", r"eagle_layers=2 sizes an EAGLE-1 head \(kind=eagle\)"),
    ("train_heads.eagle_layers=2 train_heads.init_layer=0", "init_layer starts a one-layer head"),
    ("train_heads.steps=abc", "train_heads.steps must be a number"),
    ("train_heads.vocab_top_k=-1", r"train_heads.vocab_top_k must be a whole number >= 0 \(0: the full vocabulary\)"),
    ("train_heads.vocab_top_k=abc", "train_heads.vocab_top_k must be a number"),
    ("train_heads.vocab_top_k=50000", "train_heads.vocab_top_k must be between 0"),
])
def test_bad_training_settings_are_refused_before_any_work(tmp_path, override, match):
    """A QA pass met raw tracebacks after the feature pass (lr, checkpoint_every, medusa_heads) and silent
    acceptance (steps=-3 ran and exported the head as initialised)."""
    with pytest.raises(ConfigError, match=match):
        run_train_heads(compose_config(["task=train_heads", "model=tiny_random", f"train_heads.out={tmp_path / 'out'}",
                                        f"train_heads.checkpoint_dir={tmp_path / 'ck'}", *override.split()]))
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()


def test_eagle3_layers_and_the_checkpoint_folder_are_checked_before_the_features(tmp_path):
    base = ["task=train_heads", "model=tiny_random", "train_heads.kind=eagle3", f"train_heads.out={tmp_path / 'out'}"]
    with pytest.raises(ConfigError, match=r"train_heads.aux_layers: .* layers \[0, 1, 50\]; the target has 2 layers"):
        run_train_heads(compose_config([*base, f"train_heads.checkpoint_dir={tmp_path / 'ck'}",
                                        "train_heads.aux_layers=[0,1,50]"]))
    with pytest.raises(ConfigError, match=r"EAGLE-3 fuses 3 of them"):
        run_train_heads(compose_config([*base, f"train_heads.checkpoint_dir={tmp_path / 'ck'}",
                                        "train_heads.aux_layers=[0,1]"]))
    assert not (tmp_path / "ck").exists()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="train_heads.checkpoint_dir=.*a_file is a file"):
        run_train_heads(compose_config(["task=train_heads", "model=tiny_random", f"train_heads.out={tmp_path / 'out'}",
                                        f"train_heads.checkpoint_dir={tmp_path / 'a_file'}"]))
    with pytest.raises(ConfigError, match="train_heads.out=.*a_file is a file"):  # the heads are a folder
        run_train_heads(compose_config(["task=train_heads", "model=tiny_random", f"train_heads.out={tmp_path / 'a_file'}",
                                        f"train_heads.checkpoint_dir={tmp_path / 'ck'}"]))
    assert not (tmp_path / "ck").exists()


def test_vocab_top_k_0_trains_over_the_full_vocabulary(tmp_path):
    """As drafter.vocab_top_k=0 does: the task refused 0 although the drafter takes it."""
    corpus, out = tmp_path / "corpus.parquet", tmp_path / "head"
    write_corpus(corpus)
    result = run_train_heads(compose_config([
        "task=train_heads", "model=tiny_random", f"train_heads.corpus={corpus}", f"train_heads.out={out}",
        f"train_heads.checkpoint_dir={tmp_path / 'ck'}", "train_heads.steps=0", "train_heads.vocab_top_k=0",
        "train_heads.eval_fraction=0.3", "train_heads.eval_chains=2", "train_heads.progress=false"]))
    exported = json.loads((out / "config.json").read_text())["specpipe"]
    assert exported["training"]["vocab_top_k"] == 49152 and result["eval"]["vocab_miss_rate"] == 0.0


def test_a_run_resumed_with_other_settings_is_refused(tmp_path):
    """Resumed with another head shape, the run failed in load_state_dict; with another batch it trained on
    silently and its export recorded settings it was not trained with."""
    corpus, checkpoints = tmp_path / "corpus.parquet", tmp_path / "ck"
    write_corpus(corpus)

    def config(*extra: str):
        return compose_config(["task=train_heads", "model=tiny_random", "train_heads.kind=medusa",
                               f"train_heads.corpus={corpus}", f"train_heads.checkpoint_dir={checkpoints}",
                               f"train_heads.out={tmp_path / 'out'}", "train_heads.warmup=0", "train_heads.batch=128",
                               "train_heads.checkpoint_every=2", "train_heads.eval_every=0", "train_heads.eval_init=false",
                               "train_heads.eval_fraction=0.3", "train_heads.vocab_top_k=2000",
                               "train_heads.eval_chains=4", "train_heads.progress=false", *extra])

    assert run_train_heads(config("train_heads.steps=2"))["step"] == 2
    with pytest.raises(ConfigError, match=r"other settings \(medusa_heads=3 there, 2 now\)"):
        run_train_heads(config("train_heads.steps=4", "train_heads.medusa_heads=2"))
    with pytest.raises(ConfigError, match=r"other settings \(batch=128 there, 64 now\)"):
        run_train_heads(config("train_heads.steps=4", "train_heads.batch=64"))
    assert run_train_heads(config("train_heads.steps=4", "train_heads.eval_chains=6"))["step"] == 4  # may change
    # eval_of scores the exported heads over the ranking pinned beside them; another kind's are refused
    exported = json.loads((tmp_path / "out" / "config.json").read_text())["specpipe"]["eval"]
    scored = run_train_heads(config("train_heads.steps=4", f"train_heads.eval_of={tmp_path / 'out'}"))["eval"]
    assert scored["loss"] == pytest.approx(exported["loss"], rel=0.02) and scored["positions"] == exported["positions"]
    with pytest.raises(ConfigError, match=r"out holds Medusa heads, not Hydra heads"):
        run_train_heads(config("train_heads.steps=4", "train_heads.kind=hydra", f"train_heads.eval_of={tmp_path / 'out'}"))


def test_the_loss_of_a_head_that_predicts_the_true_features(tiny_mixed):
    """The loss counts what it should: with the target's own next features as the prediction, the
    regression part is 0, top-1 agrees at every scored position (the answer is the target's greedy
    continuation), and the classification part is the target's own entropy (its minimum)."""
    from specpipe.training.eagle import head_loss

    prompt = [5, 6, 7, 8]
    answer = tiny_mixed.greedy_loop(prompt, 6, eos_token_ids=[])
    tokens = np.asarray((prompt + answer)[:-1], np.int64)
    with torch.inference_mode():
        hidden = tiny_mixed.reference(input_ids=torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states[-1][0]
    example = Example("x", tokens, len(prompt), np.asarray(answer, np.int64), len(answer))
    batch = HeadBatch([example], {"x": hidden.numpy()}, pad_id=0)
    weight = tiny_mixed.reference.lm_head.weight.detach()
    loss, stats = head_loss(batch.next_features, batch, frozen_product(weight), 0.1, torch.arange(weight.shape[0]))
    scored = batch.labels >= 0
    assert stats["positions"] == int(scored.sum()) == len(answer) and stats["misses"] == 0
    assert stats["top1"] == stats["positions"] and stats["regression"] == 0.0
    log_p = torch.log_softmax(batch.next_features[scored] @ weight.T, dim=-1)
    entropy = float(-(log_p.exp() * log_p).sum(-1).mean())
    assert stats["classification"] == pytest.approx(entropy, rel=1e-5)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_train_heads_medusa_trains_and_exports_heads_the_pipeline_loads(tmp_path, kind):
    corpus, out, checkpoints = tmp_path / "corpus.parquet", tmp_path / kind, tmp_path / "ck"
    write_corpus(corpus)
    result = run_train_heads(compose_config([
        "task=train_heads", "model=tiny_random", f"train_heads.kind={kind}", f"train_heads.corpus={corpus}",
        f"train_heads.checkpoint_dir={checkpoints}", f"train_heads.out={out}", "train_heads.steps=6",
        "train_heads.lr=0.01", "train_heads.warmup=0", "train_heads.batch=128", "train_heads.checkpoint_every=2",
        "train_heads.eval_every=0", "train_heads.eval_fraction=0.3", "train_heads.vocab_top_k=2000",
        "train_heads.medusa_heads=2", "train_heads.progress=false"]))
    losses = [entry["loss"] for entry in result["train_log"]]
    assert result["step"] == 6 and losses[-1] < losses[0]
    assert set(result["eval"]["acceptance_per_depth"]) == {"1", "2"} and len(result["eval"]["top1_per_head"]) == 2
    exported = json.loads((out / "config.json").read_text())
    assert exported["medusa_num_heads"] == 2 and exported["specpipe"]["training"]["steps"] == 6
    assert exported["hydra"] == (kind == "hydra")
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    pipe = build_pipeline(compose_config(["model=tiny_random", f"pipeline={kind}", "cost_curve=flat",
                                          f"pipeline.drafters.{kind}.path={out}", f"pipeline.drafters.{kind}.vocab_top_k=0"]),
                          loaded=loaded)
    assert len(pipe.decoder.drafters[0].heads) == 2
    assert_greedy(pipe)


def test_features_follow_the_engine_and_examples_cut_elsewhere_are_extracted_again(tmp_path, tiny_mixed):
    """The features are the target's last hidden states under the pipeline's engine (equal to
    transformers' own forward up to rounding); an example cached at another max_seq_len (another
    number of rows) is extracted again, the others are not, and the new rows are the ones read."""
    from specpipe.engine.onednn import OneDNNEngine
    from specpipe.training.features import FeatureCache, extract_features

    reference = tiny_mixed.reference
    fast = copy.deepcopy(reference)
    OneDNNEngine(fuse=True, lean_blocks=True, lean_forward=True).apply(fast)
    rng = np.random.default_rng(0)

    def example(pid: str, length: int) -> Example:
        tokens = rng.integers(3, 400, size=length)
        return Example(pid, tokens, 4, tokens[4:], length - 3)

    long, short = example("long", 40), example("short", 12)
    cache = FeatureCache(tmp_path / "features")
    extract_features(fast, [Example("long", long.tokens[:20], 4, long.answer, 17), short], cache, 64, 0, False)
    assert cache.done() == {"long": 20, "short": 12}
    extract_features(fast, [long, short], cache, 64, 0, False)  # long is now 40 rows: only it again
    assert len(cache.shards()) == 2 and cache.done() == {"long": 40, "short": 12}
    features = cache.features()
    for e in (long, short):
        with torch.inference_mode():
            expected = reference(input_ids=torch.from_numpy(e.tokens)[None], output_hidden_states=True).hidden_states[-1][0]
        assert features[e.prompt_id].shape == tuple(expected.shape)
        torch.testing.assert_close(torch.from_numpy(np.array(features[e.prompt_id])), expected, atol=2e-4, rtol=1e-4)


def test_init_layer_starts_the_head_from_the_target_layer_under_the_engine(tmp_path):
    """train_heads.init_layer copies that target layer into the head although the task runs the target
    through the pipeline's engine, which rewrites the layers into its own modules; an index outside
    the target's layers is refused."""
    from safetensors import safe_open

    corpus, out = tmp_path / "corpus.parquet", tmp_path / "head"
    write_corpus(corpus)

    def config(init_layer: int):
        return compose_config(["task=train_heads", "model=tiny_random", "engine=fast", f"train_heads.corpus={corpus}",
                               f"train_heads.checkpoint_dir={tmp_path / 'ck'}", f"train_heads.out={out}",
                               "train_heads.steps=0", "train_heads.eval_init=false", "train_heads.eval_fraction=0.3",
                               "train_heads.vocab_top_k=2000", "train_heads.eval_chains=2", "train_heads.progress=false",
                               f"train_heads.init_layer={init_layer}"])

    run_train_heads(config(1))  # no training step: the exported head is its initial state
    layer = load_model(compose_config(["model=tiny_random"]).model).model.model.layers[1]
    with safe_open(str(out / "model.safetensors"), "pt") as exported:
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            expected = layer.get_submodule(name.rsplit(".", 1)[0]).weight.detach().to(torch.bfloat16)
            assert torch.equal(exported.get_tensor(f"layers.0.{name}"), expected), name
    with pytest.raises(ConfigError, match="init_layer=7: the target has layers 0..1"):
        run_train_heads(config(7))


def test_one_rollout_is_the_plain_loss_and_more_rollouts_score_only_rows_with_a_committed_row(tiny_mixed):
    """eagle_rollout_loss with one rollout equals the plain EAGLE-1 loss (rollout 0 reads the target's
    features under a causal mask); with two, rollout 1 scores the labelled rows but the first (no
    committed row under its chain), and the total is rollout 0's loss plus decay times rollout 1's."""
    from specpipe.training.eagle import eagle_rollout_loss, head_loss, run_net
    from test_eagle import drafter_for

    net = copy.deepcopy(drafter_for(tiny_mixed).net).float()
    embed = tiny_mixed.reference.get_input_embeddings()
    rng = np.random.default_rng(1)
    examples, features = [], {}
    # two lengths (the shorter one is padded); a one-token prompt makes row 0 labelled
    for pid, length, prompt_length in (("a", 12, 1), ("b", 9, 3)):
        prompt = rng.integers(3, 400, size=prompt_length)
        answer = rng.integers(3, 400, size=length + 1 - prompt_length)
        tokens = np.concatenate([prompt, answer[:-1]])  # [length]: the last answer token is only a label
        examples.append(Example(pid, tokens, len(prompt), answer, len(answer)))
        features[pid] = rng.standard_normal((length, net.config.hidden_size)).astype(np.float32)
    batch = HeadBatch(examples, features, pad_id=0)
    reduced_head = frozen_product(tiny_mixed.reference.lm_head.weight.detach()[:300])
    to_reduced = torch.full((tiny_mixed.reference.config.vocab_size,), -1, dtype=torch.long)
    to_reduced[:300] = torch.arange(300)
    with torch.no_grad():
        plain, plain_stats = head_loss(run_net(net, embed, batch.tokens, batch.features, batch.attention_mask()),
                                       batch, reduced_head, 0.1, to_reduced)
        one, one_stats = eagle_rollout_loss(net, embed, batch, batch.features, reduced_head, 0.1, to_reduced, 1, 0.8)
        two, two_stats = eagle_rollout_loss(net, embed, batch, batch.features, reduced_head, 0.1, to_reduced, 2, 0.5)
    assert float(one) == pytest.approx(float(plain), rel=1e-5)
    assert one_stats["positions"] == plain_stats["positions"] == two_stats["positions"] > 0
    assert len(two_stats["top1_per_step"]) == 2
    # rollout 1 by hand: rows read rollout 0's output one position earlier, under rollout_mask(valid, 1)
    from transformers.cache_utils import DynamicCache

    from specpipe.training.eagle3 import rollout_mask

    width = batch.tokens.shape[1]
    positions = torch.arange(width)[None].expand(len(examples), -1)
    with torch.no_grad():
        cache = DynamicCache(config=net.config)
        out0 = net.rows(embed(batch.tokens), batch.features, positions, rollout_mask(batch.valid, 0), cache)
        shifted = torch.cat([torch.zeros_like(out0[:, :1]), out0[:, :-1]], dim=1)
        out1 = net.rows(embed(batch.tokens), shifted, positions, rollout_mask(batch.valid, 1), cache)
        keep = positions[batch.labels >= 0] >= 1  # over the labelled rows
        assert int(keep.sum()) == int((batch.labels >= 0).sum()) - 1  # "a"'s row 0 has no committed row under it
        second, _ = head_loss(out1, batch, reduced_head, 0.1, to_reduced, keep)
    assert float(two) == pytest.approx(float(one) + 0.5 * float(second), rel=1e-5)


def test_init_from_fine_tunes_a_trained_head_with_rollouts(tmp_path):
    """train_heads.init_from starts an EAGLE-1 head from a trained head's directory (its exported
    weights, exactly); with rollout_steps=2 the loss falls, and the export records both. init_from
    with another kind is refused."""
    from safetensors.torch import load_file

    from specpipe.training.eagle import head_from

    corpus, first, second = tmp_path / "corpus.parquet", tmp_path / "first", tmp_path / "second"
    write_corpus(corpus)

    def config(out: Path, checkpoints: str, steps: int, *extra: str):
        return compose_config(["task=train_heads", "model=tiny_random", f"train_heads.corpus={corpus}",
                               f"train_heads.checkpoint_dir={tmp_path / checkpoints}", f"train_heads.out={out}",
                               f"train_heads.steps={steps}", "train_heads.lr=0.003", "train_heads.warmup=0",
                               "train_heads.batch=128", "train_heads.checkpoint_every=2", "train_heads.eval_every=0",
                               "train_heads.eval_init=false", "train_heads.eval_fraction=0.3",
                               "train_heads.vocab_top_k=2000", "train_heads.eval_chains=4",
                               "train_heads.progress=false", *extra])

    run_train_heads(config(first, "ck1", 2))
    loaded = load_model(compose_config(["model=tiny_random"]).model)
    net = head_from(str(first), loaded.model, loaded.tokenizer)
    exported = load_file(first / "model.safetensors")
    for key, value in net.state_dict().items():
        if key in exported:
            assert torch.equal(value, exported[key].float()), key
    assert set(exported) >= {key for key in net.state_dict() if "rotary" not in key}

    # the start's ranking, not this corpus's, is the fine-tuned head's draft vocabulary: made unlike the corpus's here
    from specpipe.stages.draft.draft_vocab import VOCAB_FILE, TokenRanking, write_ranking

    start = np.load(first / VOCAB_FILE, allow_pickle=False)
    reversed_counts = np.arange(len(start["counts"]), dtype=np.int64)  # the highest ids first
    write_ranking(first / VOCAB_FILE, TokenRanking(reversed_counts, "a test ranking", str(start["vocab_sha256"])))
    result = run_train_heads(config(second, "ck2", 6, f"train_heads.init_from={first}", "train_heads.rollout_steps=2"))
    losses = [entry["loss"] for entry in result["train_log"]]
    assert result["step"] == 6 and losses[-1] < losses[0]
    assert np.array_equal(np.load(second / VOCAB_FILE, allow_pickle=False)["counts"], reversed_counts)
    training = json.loads((second / "config.json").read_text())["specpipe"]["training"]
    assert training["init_from"] == str(first) and training["rollout_steps"] == 2
    assert "2 rollouts" in training["loss"]
    with pytest.raises(ConfigError, match="init_from starts an EAGLE-1 head"):
        run_train_heads(config(second, "ck3", 2, f"train_heads.init_from={first}", "train_heads.kind=medusa"))
    with pytest.raises(ConfigError, match="rollout_steps must be >= 1"):
        run_train_heads(config(second, "ck4", 2, "train_heads.rollout_steps=0"))


def test_a_two_layer_head_trains_beside_the_one_layer_head_and_drafts_losslessly(tmp_path):
    """train_heads.eagle_layers=2: the head's loss falls, its checkpoints sit beside the one-layer head's on the
    same features, the export declares two layers and the pipeline drafts with both of them, greedy-exact; a
    one-layer head is not fine-tuned as a two-layer one (refused before any feature pass)."""
    from safetensors.torch import load_file

    corpus, checkpoints = tmp_path / "corpus.parquet", tmp_path / "ck"
    write_corpus(corpus)

    def config(out: Path, *extra: str):
        return compose_config(["task=train_heads", "model=tiny_random", f"train_heads.corpus={corpus}",
                               f"train_heads.checkpoint_dir={checkpoints}", f"train_heads.out={out}",
                               "train_heads.steps=6", "train_heads.lr=0.003", "train_heads.warmup=0",
                               "train_heads.batch=128", "train_heads.checkpoint_every=2", "train_heads.eval_every=0",
                               "train_heads.eval_init=false", "train_heads.eval_fraction=0.3",
                               "train_heads.vocab_top_k=2000", "train_heads.eval_chains=4",
                               "train_heads.progress=false", *extra])

    run_train_heads(config(tmp_path / "one"))
    shards = sorted((checkpoints / "features-fp32").glob("*.npy"))
    result = run_train_heads(config(tmp_path / "two", "train_heads.eagle_layers=2"))
    losses = [entry["loss"] for entry in result["train_log"]]
    assert result["step"] == 6 and losses[-1] < losses[0]
    assert sorted((checkpoints / "features-fp32").glob("*.npy")) == shards  # not extracted again
    assert (checkpoints / "eagle-fp32").is_dir() and (checkpoints / "eagle-2L-fp32").is_dir()
    assert json.loads((tmp_path / "two" / "config.json").read_text())["num_hidden_layers"] == 2
    assert {key.split(".")[1] for key in load_file(tmp_path / "two" / "model.safetensors")
            if key.startswith("layers.")} == {"0", "1"}

    loaded = load_model(compose_config(["model=tiny_random"]).model)
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=eagle", "cost_curve=flat",
                                          f"pipeline.drafters.eagle.path={tmp_path / 'two'}",
                                          "pipeline.drafters.eagle.vocab_top_k=0"]), loaded=loaded)
    assert [len(drafter.net.layers) for drafter in pipe.decoder.drafters] == [2]
    assert_greedy(pipe)
    with pytest.raises(ConfigError, match=r"that head has 1 decoder layer\(s\), train_heads.eagle_layers=2"):
        run_train_heads(config(tmp_path / "three", f"train_heads.init_from={tmp_path / 'one'}",
                               "train_heads.eagle_layers=2", f"train_heads.checkpoint_dir={tmp_path / 'ck3'}"))
    assert not (tmp_path / "ck3" / "features-fp32").exists()  # refused before the feature pass


def test_the_medusa_eval_pools_its_batches_into_the_whole_split_s_numbers(tiny_mixed):
    """The Medusa/Hydra eval runs its loss in batches of `batch` tokens (all held-out rows at once ran
    a 24 GB machine out of memory on the whole chat corpus): pooled per head, the batches give the
    numbers of one batch over the whole split (top-1 and acceptance exactly, the loss to rounding)."""
    from omegaconf import OmegaConf

    from specpipe.stages.draft.medusa import HydraHeads
    from specpipe.training.medusa import evaluate_medusa, medusa_loss, medusa_rows

    model = tiny_mixed.reference
    torch.manual_seed(0)
    heads = HydraHeads(model.config.hidden_size, 3, layers=1)
    rng = np.random.default_rng(0)
    examples, features = [], {}
    for i in range(6):
        prompt = rng.integers(5, 500, size=3 + i).tolist()
        answer = rng.integers(5, 500, size=4 + 2 * i).tolist()  # answers of unequal length: heads score unequal rows
        tokens = np.asarray((prompt + answer)[:-1], np.int64)
        with torch.inference_mode():
            hidden = model(input_ids=torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states[-1][0]
        examples.append(Example(f"p{i}", tokens, len(prompt), np.asarray(answer, np.int64), len(answer)))
        features[f"p{i}"] = hidden.numpy()
    weight = model.lm_head.weight.detach()
    reduced_ids = torch.arange(0, weight.shape[0], 2)  # half the vocabulary: some labels miss it
    to_reduced = torch.full((weight.shape[0],), -1, dtype=torch.long)
    to_reduced[reduced_ids] = torch.arange(len(reduced_ids))

    def evaluate(batch_tokens: int) -> dict:
        cfg = OmegaConf.create({"batch": batch_tokens, "medusa_decay": 0.8})
        return evaluate_medusa(heads, frozen_product(weight[reduced_ids]), reduced_ids, to_reduced, examples, features,
                               cfg, model.get_input_embeddings())

    whole, batched = evaluate(10_000), evaluate(24)
    assert whole["positions"] == batched["positions"] > 0 and 0 < whole["vocab_miss_rate"] < 1
    assert batched["top1_per_head"] == whole["top1_per_head"] and batched["top1"] == whole["top1"]
    assert batched["acceptance_per_depth"] == whole["acceptance_per_depth"]
    with torch.inference_mode():  # the training loss over every held-out row at once: what the eval reports
        loss, stats = medusa_loss(heads, medusa_rows(examples, features, 3), frozen_product(weight[reduced_ids]),
                                  to_reduced, 0.8, model.get_input_embeddings())
    assert len(set(stats["rows_per_head"])) > 1  # the heads score unequal rows: a pooling slip would show
    assert batched["top1_per_head"] == stats["top1_per_head"] and batched["positions"] == stats["positions"]
    assert batched["loss"] == pytest.approx(float(loss), rel=1e-6) == whole["loss"]
