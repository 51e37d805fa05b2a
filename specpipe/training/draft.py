"""Distilling a small draft LM (specpipe.distill.draft_model: a few of the target's layers around its embedding,
norm and output layer) on the target's own answers: the teacher's top-k logits at every answer position,
cached in resumable shards; the forward KL from them, the draft's decoder layers the only trained weights;
the eval on held-out answers (top-1 agreement, KL, greedy chain acceptance per depth); and `DraftRun`, the
scaffold's run that exports the draft with its JSON sidecar and the ranking of the tokens it learned."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specpipe.distill.draft_model import save_draft
from specpipe.training.resumable import ExampleShards, frozen_loss_head, progress_bar
from specpipe.errors import ConfigError
from specpipe.stages.draft.draft_vocab import TokenRanking, pinned_vocab_path, write_ranking
from specpipe.training.examples import Example, example_batches, fill_shards, pad_examples
from specpipe.training.scaffold import CorpusSplit, Records, Schedule, StepTrainer, TrainingRun, Window, task_log

TEACHER_VERSION = 1
LOSS = "forward KL from the teacher's top-k (renormalized)"
EVAL_KEYS = ("top1_teacher", "top1_corpus", "kl", "acceptance_per_depth", "mean_accepted_per_chain", "chains",
             "positions")


# ---- a. teacher ---------------------------------------------------------------------------------
class TeacherCache(ExampleShards):
    """Top-k teacher logits per answer position (ExampleShards `teacher-NNNNNN.*`): indices [n, k]
    int32 (`idx`), logits [n, k] fp16 (`val`), n = the example's answer positions."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, "teacher", ("idx", "val"), "distill_draft")


def compute_teacher(target, examples: list[Example], cache: TeacherCache, top_k: int, batch_tokens: int,
                    pad_id: int, progress: bool, log: Callable[[str], None] = task_log("distill_draft")) -> None:
    def arrays(chunk: list[Example]) -> dict[str, np.ndarray]:
        ids, mask, rows, cols = pad_examples(chunk, pad_id)
        hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]  # [n, H]
        values, indices = target.lm_head(hidden).float().topk(top_k, dim=-1)  # [n, k] each
        return {"idx": indices.numpy().astype(np.int32), "val": values.numpy().astype(np.float16)}

    fill_shards(cache, examples, batch_tokens, lambda e: e.n_pred, arrays, f"top-{top_k} logits", progress, log)


def teacher_logits(target, examples: list[Example], cache: TeacherCache, pin: dict, top_k: int, batch_tokens: int,
                   pad_id: int, progress: bool, log: Callable[[str], None]) -> dict:
    """prompt id -> (indices, logits) [n_pred, top_k] of every example, computed where not cached yet (the
    cache pinned to `pin`: the model, tokenizer, length and system prompt), checked against the corpus."""
    cache.pin({"version": TEACHER_VERSION, **pin, "top_k": top_k})
    compute_teacher(target, examples, cache, top_k, batch_tokens, pad_id, progress, log)
    teacher = cache.load()
    for e in examples:
        if e.prompt_id not in teacher or len(teacher[e.prompt_id][0]) != e.n_pred:
            raise ConfigError(f"the teacher cache in {cache.folder} does not match the corpus (answer {e.prompt_id}); "
                              f"delete that folder and rerun")
    # The corpus answers are the target's greedy tokens: its cached top-1 must (nearly always) equal them.
    agree = sum(int((teacher[e.prompt_id][0][:, 0] == e.answer[:e.n_pred]).sum()) for e in examples)
    log(f"teacher: top-1 equals the corpus answer token at {agree / sum(e.n_pred for e in examples):.4f} "
        f"of {sum(e.n_pred for e in examples)} answer positions")
    return teacher


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


class DraftTrainer(StepTrainer):
    """The draft's decoder layers only (the embedding, norm and LM head are the target's, frozen). `task_settings`:
    the task's settings as plain values, which ResumableTrainer reads its optimizer and batches from and pins in
    every checkpoint."""

    state_key = "layers"
    extra_counters = ("tokens",)

    def __init__(self, draft, examples: list[Example], teacher: dict, task_settings: Mapping[str, object], folder: Path,
                 pad_id: int) -> None:
        super().__init__(draft.model.layers, examples, lambda e: len(e.tokens), task_settings, folder)
        self.draft, self.teacher, self.pad_id = draft, teacher, pad_id
        # the frozen LM head's products, forward and back, are most of a step (0.9 of 1.45 s)
        self.loss_head = frozen_loss_head(draft.lm_head)

    def train_step(self) -> dict:
        """One optimizer step; returns the mean KL per answer position (`loss`) and the input `tokens`."""
        batch = self.batch_at(self.step)
        ids, mask, rows, cols = pad_examples(batch, self.pad_id)
        idx = torch.from_numpy(np.concatenate([self.teacher[e.prompt_id][0] for e in batch])).long()
        val = torch.from_numpy(np.concatenate([self.teacher[e.prompt_id][1] for e in batch]))
        self.apply_schedule()
        self.draft.train()
        hidden = self.draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]  # [n, H]
        # The [n, vocab] logits are the big tensors: the LM head and loss run chunk by chunk on a
        # detached copy of the hidden states, and their gradient flows back through the layers once.
        detached = hidden.detach().requires_grad_(True)
        n, total = len(rows), 0.0
        chunk = int(self.task_settings["loss_chunk"])
        for start in range(0, n, chunk):
            part = distill_loss(detached[start:start + chunk], self.loss_head, idx[start:start + chunk],
                                val[start:start + chunk]) / n
            part.backward()
            total += float(part.detach())
        hidden.backward(detached.grad)
        self.optimizer_step()
        self.draft.eval()
        self.step += 1
        tokens = int(mask.sum())
        self.tokens += tokens
        self.positions += n
        return {"loss": total, "tokens": tokens}

    def eval_counters(self) -> dict:
        return {"tokens": self.tokens}

    def record_counters(self) -> dict:
        return {"input_tokens": self.tokens}

    def resumed_note(self) -> str:
        return f" ({self.tokens} tokens trained)"


class DraftWindow(Window):
    """The steps' mean KL since the last checkpoint, and the input tokens per second."""

    def restart(self) -> None:
        self.losses: list[float] = []
        self.tokens, self.start, self.tok_s = 0, time.perf_counter(), 0.0

    def add(self, stats: dict) -> None:
        self.losses.append(stats["loss"])
        self.tokens += stats["tokens"]
        self.tok_s = self.tokens / max(1e-9, time.perf_counter() - self.start)

    def postfix(self) -> dict[str, str]:
        return {"loss": f"{np.mean(self.losses[-20:]):.3f}", "tok_s": f"{self.tok_s:.0f}"}

    def checkpoint(self, step: int) -> tuple[dict, str]:
        entry = {"step": step, "loss": float(np.mean(self.losses)), "tok_s": round(self.tok_s, 1)}
        return entry, (f"step {step}: loss {np.mean(self.losses):.4f} (mean of the last {len(self.losses)}), "
                       f"{self.tok_s:.0f} tok/s, checkpoint saved")

    def after_eval(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()


# ---- c. eval ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftEvalSettings:
    """The eval's settings (distill_draft.* in specpipe/conf/task/distill_draft.yaml): tokens per batch, answer
    positions per LM-head chunk, the chains (how many, how deep, drafted how many together) and their seed."""

    batch: int
    loss_chunk: int
    chain_depth: int
    seed: int
    eval_chains: int
    eval_batch: int


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


def evaluate(draft, examples: list[Example], teacher: dict, settings: DraftEvalSettings, pad_id: int,
             progress: bool) -> dict:
    """Top-1 agreement and eval KL on every held-out answer position; chain acceptance per depth on
    `eval_chains` sampled positions (the same ones at every eval: seeded). The KL is the training
    loss: it includes a floor, -log(the teacher's probability mass on its top-k), that no draft goes
    below (a draft of every target layer scores exactly that floor)."""
    draft.eval()
    agree_teacher = agree_corpus = positions = 0
    kl = 0.0
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in example_batches(examples, int(settings.batch)):
            chunk = [examples[i] for i in batch]
            ids, mask, rows, cols = pad_examples(chunk, pad_id)
            idx = torch.from_numpy(np.concatenate([teacher[e.prompt_id][0] for e in chunk])).long()
            val = torch.from_numpy(np.concatenate([teacher[e.prompt_id][1] for e in chunk]))
            answers = torch.from_numpy(np.concatenate([e.answer[:e.n_pred] for e in chunk]))
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
            for start in range(0, len(rows), int(settings.loss_chunk)):
                h = hidden[start:start + int(settings.loss_chunk)]
                end = start + len(h)
                top1 = draft.lm_head(h).argmax(-1)
                agree_teacher += int((top1 == idx[start:end, 0]).sum())
                agree_corpus += int((top1 == answers[start:end]).sum())
                kl += float(distill_loss(h, draft.lm_head, idx[start:end], val[start:end]))
            positions += len(rows)
    depth = int(settings.chain_depth)
    accepted, chains = chain_acceptance(draft, examples, settings, pad_id, progress)
    per_depth = {str(d): float(accepted[d] / max(1, chains)) for d in range(1, depth + 1)}
    return {
        "positions": positions, "chains": chains, "held_out_answers": len(examples),
        "top1_teacher": agree_teacher / max(1, positions), "top1_corpus": agree_corpus / max(1, positions),
        "kl": kl / max(1, positions),
        "acceptance_per_depth": per_depth,
        "mean_accepted_per_chain": float(sum(per_depth.values())),
        "chain_depth": depth, "seconds": round(time.perf_counter() - started, 1),
    }


def chain_acceptance(draft, examples: list[Example], settings: DraftEvalSettings, pad_id: int,
                     progress: bool) -> tuple[np.ndarray, int]:
    """(accepted[d]: the chains whose first d tokens all match the answer, chains) over `eval_chains` sampled
    answer positions, drafted `eval_batch` at a time."""
    depth = int(settings.chain_depth)
    rng = np.random.default_rng(int(settings.seed) + 1)
    candidates = [(e, t) for e in examples for t in range(e.n_pred) if t + depth <= len(e.answer)]
    picks = [candidates[i] for i in sorted(rng.choice(len(candidates), size=min(int(settings.eval_chains),
                                                                                 len(candidates)), replace=False))]
    picks.sort(key=lambda pick: pick[0].prompt_len + pick[1])  # similar lengths together: little padding
    accepted = np.zeros(depth + 1, np.int64)  # accepted[d]: chains whose first d tokens all match
    bar = progress_bar(progress, total=len(picks), unit="chain", desc="eval")
    for start in range(0, len(picks), int(settings.eval_batch)):
        group = picks[start:start + int(settings.eval_batch)]
        contexts = [np.concatenate([e.tokens[:e.prompt_len], e.answer[:t]]) for e, t in group]
        drafted = draft_chains(draft, contexts, depth, pad_id)
        for (e, t), chain in zip(group, drafted):
            matched = int(np.cumprod(chain == e.answer[t:t + depth]).sum())
            accepted[: matched + 1] += 1
        if bar is not None:
            bar.update(len(group))
    if bar is not None:
        bar.close()
    return accepted, len(picks)


def format_eval(result: dict, step: int) -> str:
    lines = [f"eval at step {step}: {result['positions']} held-out answer positions, {result['chains']} chains",
             f"  top-1 agreement with the teacher {result['top1_teacher']:.3f}, with the corpus "
             f"{result['top1_corpus']:.3f}; KL {result['kl']:.3f}",
             "  depth  acceptance"]
    lines += [f"  {d:>5}  {value:.3f}" for d, value in result["acceptance_per_depth"].items()]
    lines.append(f"  mean accepted tokens per chain of {result['chain_depth']}: "
                 f"{result['mean_accepted_per_chain']:.3f}")
    return "\n".join(lines)


# ---- d. the run and its export ------------------------------------------------------------------
class DraftRun(TrainingRun):
    """The training run of `draft` (its layers started from the target's `layers`): its evals on the teacher's
    logits, and its exports to `out` (`save_draft`: the layers and the JSON sidecar) with the `ranking` of the
    tokens it drafts over with drafter.vocab_top_k beside it."""

    def __init__(self, draft, teacher: dict, settings: DraftEvalSettings, pad_id: int, layers: list[int],
                 ranking: TokenRanking, trainer: DraftTrainer, schedule: Schedule, split: CorpusSplit, out: Path,
                 records: Records, log: Callable[[str], None]) -> None:
        super().__init__(trainer, "distill_draft", schedule, split, out, records, DraftWindow(), log)
        self.draft, self.teacher, self.settings, self.pad_id = draft, teacher, settings, pad_id
        self.layers, self.ranking = layers, ranking

    def evaluate(self) -> dict:
        return evaluate(self.draft, self.split.held_out, self.teacher, self.settings, self.pad_id,
                        self.schedule.progress)

    def describe(self, result: dict) -> str:
        return format_eval(result, result["step"])

    def export(self, result: dict) -> None:
        sidecar = save_draft(self.draft, self.out, self.export_record(result, LOSS, EVAL_KEYS))
        # The tokens it drafts over with drafter.vocab_top_k: those of the answers it learned from.
        write_ranking(pinned_vocab_path(self.out), self.ranking)
        self.log(f"exported the draft at step {self.trainer.step} to {self.out} ({sidecar['bytes'] / 1e6:.1f} MB)")

    def exported_current(self) -> bool:
        sidecar = self.out.with_suffix(".json")
        exported = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
        return (exported.get("target_layers") == self.layers
                and exported.get("training", {}).get("steps") == self.trainer.step)
