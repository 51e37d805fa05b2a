"""What every head kind trains and is scored with: the typed settings and inputs a kind reads, the training
rows of a batch (`HeadBatch`: each feature paired with the next token), the target's next-token distribution
over the reduced vocabulary, the held-out eval that drafts chains from the head's own predicted features as
the pipeline does, the trainer and what it logs between checkpoints. A kind (`HeadKind`, one module each:
eagle, eagle3, medusa) adds its net, loss, eval and export."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specpipe.training.resumable import progress_bar
from specpipe.training.examples import Example, example_batches
from specpipe.training.scaffold import StepTrainer, Window

LossFn = Callable[[list[Example]], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class HeadSettings:
    """A head run's settings as the kinds read them (train_heads.* in specpipe/conf/task/train_heads.yaml);
    `top_k`: the reduced vocabulary's size (the full vocabulary's for vocab_top_k=0), `rollouts`: the
    training-time-test rollouts per step (1: none). The loss weights are kept as given: the export's
    loss text prints them so."""

    kind: str
    top_k: int
    batch: int
    seed: int
    chain_depth: int
    eval_chains: int
    progress: bool
    class_weight: float
    feature_noise: float
    rollouts: int
    rollout_decay: float
    medusa_decay: float
    medusa_heads: int
    medusa_layers: int
    eagle_layers: int


@dataclass(frozen=True)
class HeadInputs:
    """What a head trains and is scored on: the target's features (prompt id -> [len, H]; with EAGLE-3 also the
    hidden states entering `aux_layers`, [len, 3H]), its frozen input embedding, and its output layer over the
    reduced vocabulary `reduced_ids` [K] (`reduced_head`: [n, H] -> [n, K]; `to_reduced` [vocab]: each
    token's reduced index, -1 outside)."""

    features: dict[str, np.ndarray]
    aux_features: dict[str, np.ndarray] | None
    aux_layers: tuple[int, ...]
    embed: torch.nn.Module
    reduced_head: torch.nn.Module
    reduced_ids: torch.Tensor
    to_reduced: torch.Tensor
    pad_id: int


@dataclass(frozen=True)
class HeadKind:
    """One kind of head: `new_net(target, inputs, settings, init_state)` (init_state: a target layer's
    weights for an EAGLE-1 head's layer, or None), `loss_of(net, inputs, settings)` -> the training loss of
    a batch, `evaluate(net, inputs, held_out, settings)` -> the eval's numbers, `save(net, out, record, ...)`
    in the released layout (with `ranking=` where `pins_ranking`), and the loss as the export describes it."""

    new_net: Callable[..., torch.nn.Module]
    loss_of: Callable[[torch.nn.Module, HeadInputs, HeadSettings], LossFn]
    evaluate: Callable[[torch.nn.Module, HeadInputs, list[Example], HeadSettings], dict]
    save: Callable[..., None]
    loss_text: Callable[[HeadSettings], str]
    pins_ranking: bool = True


class HeadBatch:
    """Padded training rows of a batch of examples. Row p of example e reads [embedding(s_{p+1}), f_p]
    (s = prompt + answer, f = the target's features) and is scored on predicting f_{p+1} and
    s_{p+2} where s_{p+2} is an answer token."""

    def __init__(self, examples: list[Example], features: dict[str, np.ndarray], pad_id: int,
                 inputs: dict[str, np.ndarray] | None = None) -> None:
        # `inputs`: what row p reads instead of f_p (EAGLE-3: the layers it fuses, [len, 3 * H])
        rows = [len(e.tokens) - 1 for e in examples]  # rows p = 0 .. len - 2
        width = max(rows)
        hidden = features[examples[0].prompt_id].shape[1]
        inputs = features if inputs is None else inputs
        self.tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [b, T]: s_{p+1}
        self.features = torch.zeros(len(examples), width, inputs[examples[0].prompt_id].shape[1])  # [b, T, W]: f_p
        self.next_features = torch.zeros(len(examples), width, hidden)  # [b, T, H]: f_{p+1}
        self.labels = torch.full((len(examples), width), -1, dtype=torch.long)  # [b, T]: s_{p+2}, -1 = not scored
        self.valid = torch.zeros(len(examples), width, dtype=torch.bool)  # [b, T]: real rows (attention)
        for row, (example, n) in enumerate(zip(examples, rows)):
            sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:example.n_pred]])
            f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))  # [len, H] (a copy of the memory map)
            self.tokens[row, :n] = torch.from_numpy(sequence[1:n + 1])
            self.features[row, :n] = f[:n] if inputs is features else torch.from_numpy(
                np.array(inputs[example.prompt_id][:n], dtype=np.float32))
            self.next_features[row, :n] = f[1:n + 1]
            self.valid[row, :n] = True
            labels = torch.from_numpy(sequence[2:n + 2])
            scored = torch.arange(n) + 2 >= example.prompt_len  # s_{p+2} is an answer token
            self.labels[row, :n] = torch.where(scored, labels, torch.full_like(labels, -1))

    def attention_mask(self) -> torch.Tensor:
        """[b, 1, T, T] bool: causal within each example's real rows (a padded row sees itself only)."""
        width = self.tokens.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = causal[None] & self.valid[:, None, :]
        mask |= torch.eye(width, dtype=torch.bool)[None]
        return mask[:, None]


def target_log_probs(batch: HeadBatch, reduced_head: torch.nn.Module) -> torch.Tensor:
    """[n, K] the target's next-token log-probs over the reduced vocabulary at the n labelled rows."""
    return F.log_softmax(reduced_head(batch.next_features[batch.labels >= 0]), dim=-1)


# ---- eval ---------------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate(net: torch.nn.Module, embed, scores: Callable[[torch.Tensor], torch.Tensor], reduced_ids: torch.Tensor,
             depth_one: LossFn, examples: list[Example], committed: dict, settings: HeadSettings,
             progress: bool) -> dict:
    """Depth-1 top-1 agreement with the target's greedy token over every held-out answer position
    (true features: `depth_one`, the head kind's loss), and greedy chain acceptance per depth on
    `eval_chains` sampled positions: the head reads the target's features of the context
    (`committed`: prompt id -> [len, W]) and drafts `chain_depth` tokens from its own predicted
    features, as the pipeline does (`scores`: feature [H] -> reduced-vocabulary scores [K]); depth d
    counts when its first d tokens all equal the target's answer."""
    net.eval()
    positions = top1 = misses = 0
    loss_sum = 0.0
    for batch_ids in example_batches(examples, int(settings.batch)):
        loss, stats = depth_one([examples[i] for i in batch_ids])
        positions += stats["positions"]
        top1 += stats["top1"]
        misses += stats["misses"]
        loss_sum += float(loss) * stats["positions"]
    depth = int(settings.chain_depth)
    rng = np.random.default_rng(int(settings.seed) + 1)
    # context = prompt + answer[:t] (t >= 1: the root is an answer token); the chain drafts answer[t:t + depth]
    candidates = [(e, t) for e in examples for t in range(1, e.n_pred) if t + depth <= len(e.answer)]
    picks = [candidates[i] for i in sorted(rng.choice(len(candidates),
                                                      size=min(int(settings.eval_chains), len(candidates)),
                                                      replace=False))]
    accepted = np.zeros(depth + 1, np.int64)
    bar = progress_bar(progress, total=len(picks), unit="chain", desc="eval")
    for example, t in picks:
        chain = draft_chain(net, embed, scores, reduced_ids, example, t, committed, depth)
        matched = int(np.cumprod(np.asarray(chain) == example.answer[t:t + depth]).sum())
        accepted[: matched + 1] += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    chains = max(1, len(picks))
    per_depth = {str(d): float(accepted[d] / chains) for d in range(1, depth + 1)}
    return {"positions": positions, "held_out_answers": len(examples), "chains": len(picks),
            "top1": top1 / max(1, positions), "vocab_miss_rate": misses / max(1, positions),
            "loss": loss_sum / max(1, positions), "acceptance_per_depth": per_depth,
            "mean_accepted_per_chain": float(sum(per_depth.values())), "chain_depth": depth}


def draft_chain(net: torch.nn.Module, embed, scores: Callable[[torch.Tensor], torch.Tensor],
                reduced_ids: torch.Tensor, example: Example, t: int, committed: dict, depth: int) -> list[int]:
    """The `depth` tokens the head drafts greedily after prompt + answer[:t], reading the target's features of
    that context and then its own predictions, over one cache."""
    from specpipe.kv_cache import PositionIndexedCache

    context_len = example.prompt_len + t  # tokens s_0 .. s_{L-1}; the root is s_{L-1}
    sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:]])
    f = torch.from_numpy(np.array(committed[example.prompt_id][:context_len - 1], dtype=np.float32))
    cache = PositionIndexedCache()
    rows = context_len - 1
    ids = torch.from_numpy(sequence[1:context_len])  # [rows]: s_{p+1}
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    out = net(embed(ids), f, torch.arange(rows), mask, cache)
    feature = out[-1]
    chain = []
    for step in range(depth):
        token = int(reduced_ids[scores(feature).argmax()])
        chain.append(token)
        if step + 1 < depth:
            position = rows + step
            mask = torch.ones(1, position + 1, dtype=torch.bool)
            feature = net(embed(torch.tensor([token])), feature[None], torch.tensor([position]), mask, cache)[0]
    return chain


def format_eval(result: dict, title: str) -> str:
    lines = [f"{title}: {result['positions']} held-out answer positions, {result['chains']} chains",
             f"  top-1 agreement with the target (true features) {result['top1']:.3f}; tokens outside the reduced "
             f"vocabulary {result['vocab_miss_rate']:.3f}; loss {result['loss']:.3f}",
             "  depth  chain acceptance"]
    if "top1_per_head" in result:
        lines.insert(2, "  top-1 per head: " + " ".join(f"{value:.3f}" for value in result["top1_per_head"]))
    lines += [f"  {d:>5}  {value:.3f}" for d, value in result["acceptance_per_depth"].items()]
    lines.append(f"  mean accepted tokens per chain of {result['chain_depth']}: {result['mean_accepted_per_chain']:.3f}")
    return "\n".join(lines)


# ---- train --------------------------------------------------------------------------------------
class HeadTrainer(StepTrainer):
    """`loss_of(examples)` -> (loss, stats with "positions" and "top1") is the head kind's own. `task_settings`:
    the task's settings as plain values, which ResumableTrainer reads its optimizer and batches from and pins in
    every checkpoint."""

    def __init__(self, net: torch.nn.Module, loss_of: LossFn, examples: list[Example], task_settings: Mapping[str, object],
                 folder) -> None:
        super().__init__(net, examples, lambda e: len(e.tokens), task_settings, folder)
        self.net, self.loss_of = net, loss_of

    def train_step(self) -> dict:
        examples = self.batch_at(self.step)
        self.apply_schedule()
        self.net.train()
        loss, stats = self.loss_of(examples)
        loss.backward()
        self.optimizer_step()
        self.net.eval()
        self.step += 1
        self.positions += stats["positions"]
        stats["loss"] = float(loss.detach())
        return stats

    def eval_counters(self) -> dict:
        return {"epochs": round(self.epochs(), 3)}

    def record_counters(self) -> dict:
        return {"epochs": round(self.epochs(), 3)}


class HeadWindow(Window):
    """The steps' mean loss and train top-1 since the last checkpoint, and the answer positions per second."""

    def restart(self) -> None:
        self.stats: list[dict] = []
        self.start = time.perf_counter()

    def add(self, stats: dict) -> None:
        self.stats.append(stats)

    def postfix(self) -> dict[str, str]:
        return {"loss": f"{np.mean([s['loss'] for s in self.stats[-20:]]):.3f}"}

    def checkpoint(self, step: int) -> tuple[dict, str]:
        positions = sum(s["positions"] for s in self.stats)
        entry = {"step": step, "loss": float(np.mean([s["loss"] for s in self.stats])),
                 "top1": sum(s["top1"] for s in self.stats) / max(1, positions),
                 "positions_s": round(positions / max(1e-9, time.perf_counter() - self.start), 1)}
        return entry, (f"step {step}: loss {entry['loss']:.4f}, train top-1 {entry['top1']:.3f}, "
                       f"{entry['positions_s']:.0f} positions/s, checkpoint saved")

    def after_eval(self) -> None:
        self.start = time.perf_counter()
