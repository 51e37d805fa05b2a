"""Training Medusa and Hydra heads: head k reads the target's feature f_p and is scored on s_{p+k+2}, by the
cross-entropy from the target's distribution there (weighted medusa_decay^k) through the target's shared,
frozen output layer over the reduced vocabulary; a Hydra head also reads the embeddings of the tokens before
its guess (teacher forcing). The eval pools its batches per head, and scores the chain the heads' argmaxes
draft, as `propose` does."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specpipe.stages.draft.medusa import HydraHeads, MedusaHeads, save_medusa
from specpipe.training.examples import Example, example_batches
from specpipe.training.heads import HeadInputs, HeadKind, HeadSettings, LossFn


def medusa_rows(examples: list[Example], features: dict, heads: int) -> list[tuple[torch.Tensor, ...]]:
    """Per head k: (inputs f_p [n, H], the target's features f_{p+k+1} [n, H] whose distribution is the
    soft label, the target's token s_{p+k+2} [n], the tokens before it s_{p+1} .. s_{p+k+1} [n, k + 1]
    (the root and the drafts a Hydra head reads)) over the positions p where s_{p+k+2} is an answer token."""
    parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(heads)]
    for example in examples:
        f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))  # [N, H]
        sequence = torch.from_numpy(np.concatenate([example.tokens, example.answer[example.n_pred - 1:example.n_pred]]))
        for k in range(heads):
            n = len(example.tokens) - 1 - k  # p = 0 .. N-2-k
            if n <= 0:
                continue
            scored = torch.arange(n) + k + 2 >= example.prompt_len
            before = torch.stack([sequence[j + 1:j + 1 + n] for j in range(k + 1)], dim=1)  # [n, k + 1]
            parts[k].append((f[:n][scored], f[k + 1:k + 1 + n][scored], sequence[k + 2:k + 2 + n][scored],
                             before[scored]))
    hidden = features[examples[0].prompt_id].shape[1]
    empty = (torch.zeros(0, hidden), torch.zeros(0, hidden), torch.zeros(0, dtype=torch.long),
             torch.zeros(0, 1, dtype=torch.long))
    return [tuple(torch.cat(column) for column in zip(*part)) if part else empty for part in parts]


def medusa_loss(module: MedusaHeads | HydraHeads, rows, reduced_head: torch.nn.Module, to_reduced: torch.Tensor,
                decay: float, embed) -> tuple[torch.Tensor, dict]:
    """Sum over heads of decay^k x the cross-entropy from the target's distribution at the guessed
    position (over the reduced vocabulary) to head k's, through the target's frozen output layer
    (Hydra heads also read the embeddings of the true tokens before their guess: teacher forcing)."""
    total = torch.zeros(())
    stats = {"positions": 0, "top1": 0, "misses": 0, "top1_per_head": [],
             # per head, so that an eval over many batches can pool them: rows, top-1 hits, summed cross-entropy
             "rows_per_head": [], "top1_hits_per_head": [], "cross_entropy_sum_per_head": []}
    for k, (inputs, targets, labels, before) in enumerate(rows):
        stats["rows_per_head"].append(len(labels))
        if not len(inputs):
            stats["top1_per_head"].append(0.0)
            stats["top1_hits_per_head"].append(0)
            stats["cross_entropy_sum_per_head"].append(0.0)
            continue
        prefix = embed(before) if module.hydra else None  # [n, k + 1, H]
        log_q = F.log_softmax(reduced_head(module.run(k, inputs, prefix)), dim=-1)  # [n, K]
        log_p = F.log_softmax(reduced_head(targets), dim=-1)  # [n, K]
        cross_entropy = -(log_p.exp() * log_q).sum(-1)  # [n]
        total = total + decay ** k * cross_entropy.mean()
        reduced = to_reduced[labels]
        top1 = int((log_q.argmax(-1) == reduced)[reduced >= 0].sum())
        stats["top1_per_head"].append(top1 / len(labels))
        stats["top1_hits_per_head"].append(top1)
        stats["cross_entropy_sum_per_head"].append(float(cross_entropy.detach().sum()))
        if k == 0:
            stats.update(positions=len(labels), top1=top1, misses=int((reduced < 0).sum()))
    return total, stats


def medusa_loss_of(module: MedusaHeads | HydraHeads, inputs: HeadInputs, settings: HeadSettings) -> LossFn:
    def loss_of(examples: list[Example]) -> tuple[torch.Tensor, dict]:
        rows = medusa_rows(examples, inputs.features, len(module))
        return medusa_loss(module, rows, inputs.reduced_head, inputs.to_reduced, float(settings.medusa_decay),
                           inputs.embed)
    return loss_of


@torch.inference_mode()
def evaluate_medusa(module: MedusaHeads | HydraHeads, reduced_head: torch.nn.Module, reduced_ids: torch.Tensor,
                    to_reduced: torch.Tensor, examples: list[Example], features: dict, settings: HeadSettings,
                    embed) -> dict:
    """Head k's top-1 agreement with the target's token k + 2 places on, and the chain acceptance per
    depth of the heads' argmax chain (what `propose` drafts) at every held-out answer position that
    has all of its answer tokens. (A Hydra head reads the true tokens before its guess: up to the
    first wrong draft those are the drafts, and the chain counts no further.) The loss and top-1 run
    over batches of `settings.batch` tokens: over all held-out rows at once, the [rows, K] log-probabilities
    of a 775-answer split (159K positions, 5.2 GB each) ran a 24 GB machine out of memory."""
    heads = len(module)
    decay = float(settings.medusa_decay)
    rows_per_head = np.zeros(heads, np.int64)
    hits_per_head = np.zeros(heads, np.int64)
    cross_entropy_per_head = np.zeros(heads)
    scored = top1 = misses = 0  # head 0's scored rows, its top-1 hits, its labels outside the reduced vocabulary
    for batch_ids in example_batches(examples, int(settings.batch)):
        rows = medusa_rows([examples[i] for i in batch_ids], features, heads)
        _, stats = medusa_loss(module, rows, reduced_head, to_reduced, decay, embed)
        rows_per_head += stats["rows_per_head"]
        hits_per_head += stats["top1_hits_per_head"]
        cross_entropy_per_head += stats["cross_entropy_sum_per_head"]
        scored, top1, misses = scored + stats["positions"], top1 + stats["top1"], misses + stats["misses"]
    loss = sum(decay ** k * cross_entropy_per_head[k] / rows_per_head[k] for k in range(heads) if rows_per_head[k])
    top1_per_head = [float(hits / max(1, n)) for hits, n in zip(hits_per_head, rows_per_head)]
    accepted, chains = chain_acceptance(module, reduced_head, reduced_ids, examples, features, embed)
    per_depth = {str(d): float(accepted[d] / max(1, chains)) for d in range(1, heads + 1)}
    return {"positions": scored, "held_out_answers": len(examples), "chains": chains,
            "top1": top1 / max(1, scored), "top1_per_head": top1_per_head,
            "vocab_miss_rate": misses / max(1, scored), "loss": float(loss),
            "acceptance_per_depth": per_depth, "mean_accepted_per_chain": float(sum(per_depth.values())),
            "chain_depth": heads}


def chain_acceptance(module: MedusaHeads | HydraHeads, reduced_head: torch.nn.Module, reduced_ids: torch.Tensor,
                     examples: list[Example], features: dict, embed) -> tuple[np.ndarray, int]:
    """(accepted[d]: the chains whose first d drafts all equal the answer, chains): the heads' argmax chain at
    every answer position of `examples` that has all of its answer tokens."""
    heads = len(module)
    accepted = np.zeros(heads + 1, np.int64)
    chains = 0
    for example in examples:
        f = torch.from_numpy(np.array(features[example.prompt_id], dtype=np.float32))
        sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:]])
        positions = np.arange(max(0, example.prompt_len - 2), min(len(example.tokens) - 1, len(sequence) - heads - 1))
        if not len(positions):
            continue
        ids = torch.from_numpy(sequence)
        prefixes = [embed(torch.stack([ids[positions + 1 + j] for j in range(k + 1)], dim=1)) if module.hydra else None
                    for k in range(heads)]  # [n, k + 1, H]: the root and the tokens before head k's guess
        drafted = np.stack([reduced_ids[reduced_head(module.run(k, f[positions], prefixes[k])).argmax(-1)].numpy()
                            for k in range(heads)], axis=1)  # [n, heads]: the chain each position drafts
        truth = np.stack([sequence[positions + 2 + k] for k in range(heads)], axis=1)  # [n, heads]
        matched = np.cumprod(drafted == truth, axis=1).sum(axis=1)  # [n]
        for count in matched:
            accepted[: count + 1] += 1
        chains += len(positions)
    return accepted, chains


def evaluate_heads(module: MedusaHeads | HydraHeads, inputs: HeadInputs, examples: list[Example],
                   settings: HeadSettings) -> dict:
    return evaluate_medusa(module, inputs.reduced_head, inputs.reduced_ids, inputs.to_reduced, examples,
                           inputs.features, settings, inputs.embed)


def new_heads(heads_class: type[MedusaHeads] | type[HydraHeads], target, settings: HeadSettings) -> torch.nn.Module:
    """Heads shaped by `medusa_heads` and `medusa_layers`, started as Medusa starts them."""
    net = heads_class(int(target.config.hidden_size), int(settings.medusa_heads), int(settings.medusa_layers))
    net.start_as_medusa()
    return net


def loss_text(settings: HeadSettings) -> str:
    return (f"sum over heads of {settings.medusa_decay}^k x CE from the target's distribution, top "
            f"{settings.top_k} tokens")


MEDUSA = HeadKind(new_net=lambda target, inputs, settings, init_state: new_heads(MedusaHeads, target, settings),
                  loss_of=medusa_loss_of, evaluate=evaluate_heads, save=save_medusa, loss_text=loss_text)
HYDRA = HeadKind(new_net=lambda target, inputs, settings, init_state: new_heads(HydraHeads, target, settings),
                 loss_of=medusa_loss_of, evaluate=evaluate_heads, save=save_medusa, loss_text=loss_text)
