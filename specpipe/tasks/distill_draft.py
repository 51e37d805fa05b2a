"""`task=distill_draft`: a small draft LM for the target, distilled on the target's own answers.

The draft (specpipe.distill.draft_model) is a few of the target's decoder layers, copied and then
trained, around the target's own embedding, final norm and LM head (shared, frozen). The data is
the self-distilled chat corpus (data/self_distill/: the target's greedy answers to chat prompts),
so the draft learns the distribution it is verified against. Four stages, each resumable (kill the
run at any time and start it again):

a. teacher: the target (fp32, no grad, batched, through `engine` like a pipeline's target) over
   prompt + answer; the top-k logits of every answer position go to .npy shards in
   `<checkpoint_dir>/teacher/` (a finished shard is skipped).
b. train: the draft's decoder layers only, forward KL from the teacher's top-k distribution,
   AdamW with warmup and cosine decay, a checkpoint every `checkpoint_every` steps
   (`<checkpoint_dir>/train-layers-*/checkpoint-*.pt`, tensors only), resumed from the last one.
c. eval on the held-out prompts (a hash of prompt_id): top-1 agreement with the teacher, and greedy
   chain acceptance per depth (the draft drafts `chain_depth` tokens from a sampled answer
   position; depth d counts when its first d tokens all equal the corpus answer, i.e. the target's
   own greedy continuation). A table on stderr and `report.json` beside the checkpoints.
d. export: `save_draft` to `out` (bf16 layers + JSON sidecar with the command and the eval).

`init_from=DRAFT.safetensors` grows a trained draft instead of starting from copies: its layers keep their
weights and `layers` adds new ones around them, each starting with its residual outputs zeroed
(`specpipe.distill.draft_model.grow_draft`), in a run folder of its own (`train-layers-...-from-<sha>`).

The command that built data/draft/smollm2_135m_draft.safetensors is in its .json sidecar: all 14,889
usable answers of the shipped 3.14M-token corpus (14,120 to train on, 2.79M answer positions; 4.82M trained,
1.7 epochs, in 4400 steps); the teacher pass and the training take about an hour each on a 2-core CPU VM
(docs/notebook/run-47.md). Training is deterministic on one machine: a run stopped and resumed exports the
bytes an uninterrupted one does; another engine for the teacher or the loss changes the weights by float
rounding only. `limit` may change on resume (a grown corpus), so start in a checkpoint folder of its own.
Run it niced and in the background:

    OMP_WAIT_POLICY=PASSIVE nice -n 19 nohup .venv/bin/python run.py task=distill_draft distill_draft.steps=4400 \\
        distill_draft.eval_every=1100 distill_draft.checkpoint_dir=$HOME/.cache/specpipe/distill_draft/all_answers \\
        >> ~/.cache/specpipe/distill_draft/all_answers.log 2>&1 &
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from specpipe.distill.corpus import chat_prompt_ids, check_corpus_tokenizer, read_corpus, read_corpus_metadata
from specpipe.distill.prompts import prompt_id as text_id
from specpipe.distill.draft_model import build_draft, grow_draft, save_draft
from specpipe.stages.draft.draft_model import corpus_ranking
from specpipe.stages.draft.draft_vocab import pinned_vocab_path, write_ranking
from specpipe.distill.training import (AT_LEAST_ONE, ExampleShards, ResumableTrainer, check_folder, check_output_file,
                                       check_task_settings, finished_message, frozen_loss_head, lock_folder,
                                       progress_bar, token_batches, write_json)
from specpipe.errors import ConfigError
from specpipe.models import cache_root
from specpipe.paths import local_path, package_path
from specpipe.pipelines.builder import build_engine, load_model
from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint
from specpipe.tasks import task_command

TEACHER_VERSION = 1


def _log(message: str) -> None:
    print(f"distill_draft: {message}", file=sys.stderr, flush=True)


# ---- data ---------------------------------------------------------------------------------------
@dataclass
class Example:
    """One corpus answer as the draft sees it. The input is (prompt + answer)[:-1] cut to max_seq_len;
    input position prompt_len - 1 + j predicts answer token j, for j < n_pred."""

    prompt_id: str
    tokens: np.ndarray   # [len] int64: the input ids
    prompt_len: int
    answer: np.ndarray   # [A] int64: the whole answer (the targets, and the chain references)
    n_pred: int          # answer positions predicted (= cached teacher rows)
    # What the held-out split hashes: the conversation's first turn's id, so a second turn falls on
    # the same side as the first answer it reads (None: prompt_id, a first turn).
    conversation_id: str | None = None

    @property
    def split_id(self) -> str:
        return self.conversation_id or self.prompt_id


def is_eval(prompt_id: str, fraction: float) -> bool:
    """The held-out split: a stable hash of the prompt id, so it never depends on corpus order."""
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def split_held_out(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: the held-out ones are those `is_eval` picks at `fraction`."""
    train, held_out = [], []
    for example in examples:
        (held_out if is_eval(example.split_id, fraction) else train).append(example)
    return train, held_out


def read_task_corpus(corpus: Path, option: str, tokenizer, vocab_sha256: str, model_name: str, max_seq_len: int,
                     default_system_prompt: str | None) -> tuple[list[Example], str | None]:
    """A self-distilled corpus as a training task reads it: its answers as examples, and the system prompt
    they were generated under (the corpus metadata's, else `default_system_prompt`). Refused when the
    corpus is missing (the message names `option`, the config key that points at it) or was generated
    with another tokenizer."""
    if not corpus.is_file():
        raise ConfigError(f"no corpus at {corpus}: build it with `python run.py task=distill_corpus`, or set {option}")
    metadata = read_corpus_metadata(corpus)
    check_corpus_tokenizer(corpus, metadata, vocab_sha256, model_name)
    system_prompt = metadata.get("system_prompt", default_system_prompt)
    return load_examples(corpus, tokenizer, max_seq_len, system_prompt), system_prompt


def load_examples(corpus: Path, tokenizer, max_seq_len: int, system_prompt: str | None) -> list[Example]:
    table = read_corpus(corpus)
    examples = []
    columns = (table.column(c).to_pylist() for c in ("prompt_id", "prompt", "answer_ids", "history"))
    for pid, prompt, answer, history in zip(*columns):
        # The prompt ids exactly as the Pipeline encodes the chat (the corpus was generated so).
        prompt_ids = chat_prompt_ids(tokenizer, prompt, system_prompt, history)
        if not answer or len(prompt_ids) > max_seq_len:
            continue
        tokens = (prompt_ids + list(answer))[:-1][:max_seq_len]
        first_turn = text_id(history[0]) if history else None  # a first turn's id hashes its text
        examples.append(Example(pid, np.asarray(tokens, np.int64), len(prompt_ids), np.asarray(answer, np.int64),
                                len(tokens) - len(prompt_ids) + 1, first_turn))
    return examples


def pad_id_of(tokenizer) -> int:
    """The id that pads a batch of examples: the tokenizer's pad token, else its EOS (SmolLM2 has no pad token)."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def pad_examples(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [b, T], attention mask [b, T], and the (row, column) of every answer position [n]."""
    width = max(len(e.tokens) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    rows, cols = [], []
    for row, example in enumerate(examples):
        ids[row, :len(example.tokens)] = torch.from_numpy(example.tokens)
        mask[row, :len(example.tokens)] = 1
        rows.append(np.full(example.n_pred, row))
        cols.append(np.arange(example.prompt_len - 1, example.prompt_len - 1 + example.n_pred))
    return ids, mask, torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(cols))


def example_batches(examples: list[Example], batch_tokens: int) -> list[list[int]]:
    """Indices of `examples` in batches of at most `batch_tokens` padded input tokens (token_batches)."""
    return token_batches([len(e.tokens) for e in examples], batch_tokens)


# ---- a. teacher ---------------------------------------------------------------------------------
class TeacherCache(ExampleShards):
    """Top-k teacher logits per answer position (ExampleShards `teacher-NNNNNN.*`): indices [n, k]
    int32 (`idx`), logits [n, k] fp16 (`val`), n = the example's answer positions."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, "teacher", ("idx", "val"), "distill_draft")


def fill_shards(cache: ExampleShards, examples: list[Example], batch_tokens: int, rows: Callable[[Example], int],
                arrays: Callable[[list[Example]], dict[str, np.ndarray]], what: str, progress: bool,
                log: Callable[[str], None]) -> None:
    """Computes `arrays(batch)` (each [sum of rows(example), ...]) for every example not in `cache` yet,
    in batches of at most `batch_tokens` padded tokens, one shard per batch (a killed run resumes).
    An example cached with another number of rows (cut at another max_seq_len) is computed again."""
    done = cache.done()
    todo = [e for e in examples if done.get(e.prompt_id) != rows(e)]
    if not todo:
        return
    next_index = cache.next_index()
    total = sum(len(e.tokens) for e in todo)
    log(f"{cache.prefix}: {what} of {len(todo)} answers ({total} tokens; {len(done)} cached)")
    bar = progress_bar(progress, total=total, unit="tok", desc=cache.prefix)
    started, seen = time.perf_counter(), 0
    try:
        for batch in example_batches(todo, batch_tokens):
            chunk = [todo[i] for i in batch]
            with torch.inference_mode():
                computed = arrays(chunk)
            cache.write(next_index, [e.prompt_id for e in chunk], [rows(e) for e in chunk], computed)
            next_index += 1
            tokens = sum(len(e.tokens) for e in chunk)
            seen += tokens
            if bar is not None:
                bar.update(tokens)
                bar.set_postfix(tok_s=f"{seen / (time.perf_counter() - started):.0f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    log(f"{cache.prefix}: {seen} tokens in {time.perf_counter() - started:.0f} s")


def compute_teacher(target, examples: list[Example], cache: TeacherCache, top_k: int, batch_tokens: int,
                    pad_id: int, progress: bool) -> None:
    def arrays(chunk: list[Example]) -> dict[str, np.ndarray]:
        ids, mask, rows, cols = pad_examples(chunk, pad_id)
        hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]  # [n, H]
        values, indices = target.lm_head(hidden).float().topk(top_k, dim=-1)  # [n, k] each
        return {"idx": indices.numpy().astype(np.int32), "val": values.numpy().astype(np.float16)}

    fill_shards(cache, examples, batch_tokens, lambda e: e.n_pred, arrays, f"top-{top_k} logits", progress, _log)


# ---- b. train -----------------------------------------------------------------------------------
def distill_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, teacher_idx: torch.Tensor,
                 teacher_val: torch.Tensor) -> torch.Tensor:
    """Summed forward KL(p_teacher || q_draft) over positions; hidden [n, H], teacher_* [n, k].

    DistillSpec-style forward KL (the teacher's distribution as the target, "mode covering"): the
    draft is verified against the target's greedy choice, so the mass the teacher puts on its top
    tokens is what the draft must reproduce. Only the teacher's top-k logits are cached, so p is the
    softmax over those k (renormalized); q is the draft's FULL-vocabulary log-softmax gathered at
    the same ids, so mass the draft puts outside the teacher's top-k is penalised too (through the
    normalizer) and the loss is >= 0 with 0 only when q matches p on the top-k and is 0 elsewhere.
    """
    log_q = F.log_softmax(lm_head(hidden).float(), dim=-1).gather(1, teacher_idx)  # [n, k]
    log_p = F.log_softmax(teacher_val.float(), dim=-1)                            # [n, k]
    return (log_p.exp() * (log_p - log_q)).sum()


def lr_at(step: int, lr: float, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to lr * min_ratio at `steps` (held after)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer(ResumableTrainer):
    """The draft's decoder layers only (the embedding, norm and LM head are the target's, frozen)."""

    state_key = "layers"
    extra_counters = ("tokens",)

    def __init__(self, draft, examples: list[Example], teacher: dict, cfg: DictConfig, folder: Path,
                 pad_id: int) -> None:
        super().__init__(draft.model.layers, examples, lambda e: len(e.tokens), cfg, folder)
        self.draft, self.teacher, self.pad_id = draft, teacher, pad_id
        # the frozen LM head's products, forward and back, are most of a step (0.9 of 1.45 s)
        self.loss_head = frozen_loss_head(draft.lm_head)

    def train_step(self) -> tuple[float, int]:
        """One optimizer step; returns (mean KL per answer position, input tokens)."""
        cfg = self.cfg
        batch = self.batch_at(self.step)
        ids, mask, rows, cols = pad_examples(batch, self.pad_id)
        idx = torch.from_numpy(np.concatenate([self.teacher[e.prompt_id][0] for e in batch])).long()
        val = torch.from_numpy(np.concatenate([self.teacher[e.prompt_id][1] for e in batch]))
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, float(cfg.lr), int(cfg.warmup), int(cfg.steps), float(cfg.min_lr_ratio))
        self.draft.train()
        hidden = self.draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]  # [n, H]
        # The [n, vocab] logits are the big tensors: the LM head and loss run chunk by chunk on a
        # detached copy of the hidden states, and their gradient flows back through the layers once.
        detached = hidden.detach().requires_grad_(True)
        n, total = len(rows), 0.0
        chunk = int(cfg.loss_chunk)
        for start in range(0, n, chunk):
            part = distill_loss(detached[start:start + chunk], self.loss_head, idx[start:start + chunk],
                                val[start:start + chunk]) / n
            part.backward()
            total += float(part.detach())
        hidden.backward(detached.grad)
        torch.nn.utils.clip_grad_norm_(self.params, float(cfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.draft.eval()
        self.step += 1
        tokens = int(mask.sum())
        self.tokens += tokens
        self.positions += n
        return total, tokens


# ---- c. eval ------------------------------------------------------------------------------------
@torch.inference_mode()
def draft_chains(draft, contexts: list[np.ndarray], depth: int, pad_id: int) -> np.ndarray:
    """Greedy chains of `depth` tokens after each context, drafted together: left-padded, position
    ids from the mask, the draft's KV cache across steps. Returns [len(contexts), depth]."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context):] = torch.from_numpy(context)
        mask[row, width - len(context):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = draft(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1].argmax(-1)]
    last = positions[:, -1:]
    for _ in range(depth - 1):
        mask = torch.cat([mask, torch.ones((len(contexts), 1), dtype=torch.long)], dim=1)
        last = last + 1
        out = draft(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=last,
                    past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1).numpy()


def evaluate(draft, examples: list[Example], teacher: dict, cfg: DictConfig, pad_id: int, progress: bool) -> dict:
    """Top-1 agreement and eval KL on every held-out answer position; chain acceptance per depth on
    `eval_chains` sampled positions (the same ones at every eval: seeded). The KL is the training
    loss: it includes a floor, -log(the teacher's probability mass on its top-k), that no draft goes
    below (a draft of every target layer scores exactly that floor)."""
    draft.eval()
    agree_teacher = agree_corpus = positions = 0
    kl = 0.0
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in example_batches(examples, int(cfg.batch)):
            chunk = [examples[i] for i in batch]
            ids, mask, rows, cols = pad_examples(chunk, pad_id)
            idx = torch.from_numpy(np.concatenate([teacher[e.prompt_id][0] for e in chunk])).long()
            val = torch.from_numpy(np.concatenate([teacher[e.prompt_id][1] for e in chunk]))
            answers = torch.from_numpy(np.concatenate([e.answer[:e.n_pred] for e in chunk]))
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
            for start in range(0, len(rows), int(cfg.loss_chunk)):
                h = hidden[start:start + int(cfg.loss_chunk)]
                end = start + len(h)
                top1 = draft.lm_head(h).argmax(-1)
                agree_teacher += int((top1 == idx[start:end, 0]).sum())
                agree_corpus += int((top1 == answers[start:end]).sum())
                kl += float(distill_loss(h, draft.lm_head, idx[start:end], val[start:end]))
            positions += len(rows)
    depth = int(cfg.chain_depth)
    rng = np.random.default_rng(int(cfg.seed) + 1)
    candidates = [(e, t) for e in examples for t in range(e.n_pred) if t + depth <= len(e.answer)]
    picks = [candidates[i] for i in sorted(rng.choice(len(candidates), size=min(int(cfg.eval_chains),
                                                                                 len(candidates)), replace=False))]
    picks.sort(key=lambda pick: pick[0].prompt_len + pick[1])  # similar lengths together: little padding
    accepted = np.zeros(depth + 1, np.int64)  # accepted[d]: chains whose first d tokens all match
    bar = progress_bar(progress, total=len(picks), unit="chain", desc="eval")
    for start in range(0, len(picks), int(cfg.eval_batch)):
        group = picks[start:start + int(cfg.eval_batch)]
        contexts = [np.concatenate([e.tokens[:e.prompt_len], e.answer[:t]]) for e, t in group]
        drafted = draft_chains(draft, contexts, depth, pad_id)
        for (e, t), chain in zip(group, drafted):
            matched = int(np.cumprod(chain == e.answer[t:t + depth]).sum())
            accepted[: matched + 1] += 1
        if bar is not None:
            bar.update(len(group))
    if bar is not None:
        bar.close()
    chains = max(1, len(picks))
    per_depth = {str(d): float(accepted[d] / chains) for d in range(1, depth + 1)}
    return {
        "positions": positions, "chains": len(picks), "held_out_answers": len(examples),
        "top1_teacher": agree_teacher / max(1, positions), "top1_corpus": agree_corpus / max(1, positions),
        "kl": kl / max(1, positions),
        "acceptance_per_depth": per_depth,
        "mean_accepted_per_chain": float(sum(per_depth.values())),
        "chain_depth": depth, "seconds": round(time.perf_counter() - started, 1),
    }


def format_eval(result: dict, step: int) -> str:
    lines = [f"eval at step {step}: {result['positions']} held-out answer positions, {result['chains']} chains",
             f"  top-1 agreement with the teacher {result['top1_teacher']:.3f}, with the corpus "
             f"{result['top1_corpus']:.3f}; KL {result['kl']:.3f}",
             "  depth  acceptance"]
    lines += [f"  {d:>5}  {value:.3f}" for d, value in result["acceptance_per_depth"].items()]
    lines.append(f"  mean accepted tokens per chain of {result['chain_depth']}: "
                 f"{result['mean_accepted_per_chain']:.3f}")
    return "\n".join(lines)


# ---- the task -----------------------------------------------------------------------------------
def run_distill_draft(cfg: DictConfig) -> dict:
    d = cfg.distill_draft
    check_task_settings(d, "distill_draft", {key: AT_LEAST_ONE for key in
                                             ("teacher_top_k", "teacher_batch", "loss_chunk", "eval_batch")})
    if d.get("out") and Path(str(d.out)).suffix != ".safetensors":
        raise ConfigError(f"distill_draft.out={d.out}: the draft is one .safetensors file (drafter.path reads it by "
                          f"that suffix); name it ...{Path(str(d.out)).stem}.safetensors")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(d.seed))
    loaded = load_model(cfg.model)
    target, tokenizer = loaded.model.eval(), loaded.tokenizer
    if target.dtype != torch.float32:
        raise ConfigError(f"task=distill_draft runs the target in fp32 (teacher logits, training); got "
                          f"model.dtype={cfg.model.dtype}: use model.dtype=fp32")
    layers = [int(layer) for layer in d.layers]
    init_from = local_path(d.init_from) if d.get("init_from") else None
    # checks the layers (and the draft grown from) before any long stage
    draft = grow_draft(target, tokenizer, init_from, layers) if init_from else build_draft(target, layers)
    # The teacher runs through the pipeline's engine (about twice transformers' own forward's speed in fp32,
    # the same top-1 at every position, only the float rounding of the logits differs), after
    # the draft copied its layers: the engine rewrites the target's linears into its own modules. The
    # draft shares the target's original embedding, norm and output layer, which the engine leaves as
    # they are. Engines change only the float rounding, so the teacher cache does not pin them.
    build_engine(cfg).apply(target)
    out = package_path(d.out) if d.get("out") else package_path(f"data/draft/{loaded.name}_draft.safetensors")
    check_output_file(out, "distill_draft.out", f"{loaded.name}_draft.safetensors")
    if init_from and out.resolve() == init_from.resolve():
        raise ConfigError(f"distill_draft.out is distill_draft.init_from ({out}): the exports would overwrite the "
                          f"draft being grown (and a resumed run would no longer find it); write the grown draft "
                          f"elsewhere, e.g. distill_draft.out={out.with_name(out.stem + '_grown.safetensors')}")
    if int(d.teacher_top_k) > int(target.config.vocab_size):
        raise ConfigError(f"distill_draft.teacher_top_k must be at most the vocabulary size "
                          f"{target.config.vocab_size}, got {d.teacher_top_k}")
    corpus = local_path(d.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    examples, system_prompt = read_task_corpus(corpus, "distill_draft.corpus", tokenizer, fingerprint["vocab_sha256"],
                                               loaded.name, int(d.max_seq_len), cfg.get("system_prompt"))
    if d.get("limit"):
        examples = examples[: int(d.limit)]
    train, held_out = split_held_out(examples, float(d.eval_fraction))
    if not train or not held_out:
        raise ConfigError(f"the corpus {corpus} gives {len(train)} training and {len(held_out)} held-out answers "
                          f"(eval_fraction={d.eval_fraction}): both must be non-empty")
    folder = package_path(d.checkpoint_dir) if d.get("checkpoint_dir") else cache_root() / "distill_draft" / loaded.name
    check_folder(folder, "distill_draft.checkpoint_dir")
    pad_id = pad_id_of(tokenizer)
    grown = f" (grown from {init_from}, trained from layers {draft.grown_from['target_layers']})" if init_from else ""
    _log(f"{len(train)} training / {len(held_out)} held-out answers "
         f"({sum(e.n_pred for e in train)} / {sum(e.n_pred for e in held_out)} answer positions); "
         f"draft = target layers {layers}{grown}; checkpoints in {folder}")

    lock = lock_folder(folder, "distill_draft")  # noqa: F841 (held until the run ends: two runs would write the same shards)

    # a. teacher
    cache = TeacherCache(folder / "teacher")
    cache.pin({"version": TEACHER_VERSION, "model": loaded.name, "tokenizer": fingerprint["vocab_sha256"],
               "top_k": int(d.teacher_top_k), "max_seq_len": int(d.max_seq_len), "system_prompt": system_prompt})
    compute_teacher(target, examples, cache, int(d.teacher_top_k), int(d.teacher_batch), pad_id, bool(d.progress))
    teacher = cache.load()
    for e in examples:
        if e.prompt_id not in teacher or len(teacher[e.prompt_id][0]) != e.n_pred:
            raise ConfigError(f"the teacher cache in {cache.folder} does not match the corpus (answer {e.prompt_id}); "
                              f"delete that folder and rerun")
    # The corpus answers are the target's greedy tokens: its cached top-1 must (nearly always) equal them.
    agree = sum(int((teacher[e.prompt_id][0][:, 0] == e.answer[:e.n_pred]).sum()) for e in examples)
    _log(f"teacher: top-1 equals the corpus answer token at {agree / sum(e.n_pred for e in examples):.4f} "
         f"of {sum(e.n_pred for e in examples)} answer positions")

    if d.get("teacher_only"):
        _log(f"teacher logits of {len(teacher)} answers in {cache.folder}; stopping there (teacher_only)")
        return {"teacher": str(cache.folder), "answers": len(teacher)}

    # b. train (c. and d. along the way: every eval exports the draft)
    # A grown draft trains in a folder of its own: its checkpoints continue another draft's weights.
    init_sha256 = sha256_file(init_from) if init_from else None
    grown_tag = f"-from-{init_sha256[:12]}" if init_sha256 else ""
    run_folder = folder / f"train-layers-{'-'.join(map(str, layers))}{grown_tag}"
    run_folder.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(draft, train, teacher, d, run_folder, pad_id)
    if trainer.resume(_log):
        _log(f"resumed from step {trainer.step} ({trainer.tokens} tokens trained)")
        if finished := finished_message("distill_draft", trainer.step, int(d.steps)):
            _log(finished)
    report_path = run_folder / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"evals": []}
    ranking = corpus_ranking(str(corpus), loaded.tokenizer)  # exported beside the draft

    def run_eval(export: bool) -> dict:
        result = evaluate(draft, held_out, teacher, d, pad_id, bool(d.progress))
        result.update(step=trainer.step, tokens=trainer.tokens, positions_trained=trainer.positions,
                      train_seconds=round(trainer.seconds, 1))
        _log(format_eval(result, trainer.step))
        report["evals"] = [r for r in report["evals"] if r["step"] != trainer.step] + [result]
        report.update(layers=layers, model=loaded.name, command=task_command("distill_draft"),
                      settings=OmegaConf.to_container(d))
        write_json(report_path, report)
        if export:
            sidecar = save_draft(draft, out, {
                "base_model": loaded.name, "target_layers": layers, "tokenizer": fingerprint,
                **({"init_from": {"file": str(d.init_from), "sha256": init_sha256,
                                  "target_layers": draft.grown_from["target_layers"]}} if init_from else {}),
                "command": task_command("distill_draft"),
                "corpus": {"file": str(d.corpus), "sha256": sha256_file(corpus), "answers": len(examples),
                           "held_out_answers": len(held_out), "eval_fraction": float(d.eval_fraction)},
                "training": {"steps": trainer.step, "input_tokens": trainer.tokens,
                             "answer_positions": trainer.positions, "seconds": round(trainer.seconds, 1),
                             "loss": "forward KL from the teacher's top-k (renormalized)",
                             "teacher_top_k": int(d.teacher_top_k), "lr": float(d.lr), "batch_tokens": int(d.batch),
                             "max_seq_len": int(d.max_seq_len)},
                "eval": {k: result[k] for k in ("top1_teacher", "top1_corpus", "kl", "acceptance_per_depth",
                                                "mean_accepted_per_chain", "chains", "positions")},
            })
            # The tokens it drafts over with drafter.vocab_top_k: those of the answers it learned from.
            write_ranking(pinned_vocab_path(out), ranking)
            _log(f"exported the draft at step {trainer.step} to {out} ({sidecar['bytes'] / 1e6:.1f} MB)")
        return result

    if d.eval_init and trainer.step == 0 and not any(r["step"] == 0 for r in report["evals"]):
        run_eval(export=False)
    steps, every, eval_every = int(d.steps), int(d.checkpoint_every), int(d.eval_every)
    bar = progress_bar(bool(d.progress), total=steps, initial=min(trainer.step, steps), unit="step", desc="train")
    window_loss, window_tokens, window_start = [], 0, time.perf_counter()
    try:
        while trainer.step < steps:
            started = time.perf_counter()
            loss, tokens = trainer.train_step()
            trainer.seconds += time.perf_counter() - started
            window_loss.append(loss)
            window_tokens += tokens
            tok_s = window_tokens / max(1e-9, time.perf_counter() - window_start)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(window_loss[-20:]):.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            if trainer.step % every == 0 or trainer.step == steps:
                trainer.save()
                _log(f"step {trainer.step}: loss {np.mean(window_loss):.4f} (mean of the last {len(window_loss)}), "
                     f"{tok_s:.0f} tok/s, checkpoint saved")
                report.setdefault("train_log", []).append(
                    {"step": trainer.step, "loss": float(np.mean(window_loss)), "tok_s": round(tok_s, 1)})
                write_json(report_path, report)
                window_loss, window_tokens, window_start = [], 0, time.perf_counter()
            if eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
                run_eval(export=True)
                window_tokens, window_start = 0, time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
    # Export once training ends (a rerun after the end only exports again when `out` holds another draft).
    final = next((r for r in report["evals"] if r["step"] == trainer.step), None)
    exported = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    if (final is None or exported.get("target_layers") != layers
            or exported.get("training", {}).get("steps") != trainer.step):
        final = run_eval(export=True)
    return {"step": trainer.step, "out": str(out), "report": str(report_path), "eval": final,
            "train_log": report.get("train_log", [])}
