"""`task=calibrate_tree`: a static tree for Medusa or Hydra heads from their measured accuracy.

Medusa builds its sparse tree from the heads' calibrated top-k accuracies; this task does so
without assuming the heads independent. Every held-out answer of the self-distilled corpus (the
target's own greedy answers; the split `task=train_heads` never trains on) runs through the target
once. At each answer position the heads rank the target's next tokens among their guesses
(`MedusaDrafter.true_path_ranks`), and each top-k path's probability is the share of positions
whose continuation it was (specpipe.stages.tree.calibration). The most frequent paths go to
`calibrate_tree.out` with the data they came from; `tree=static calibration=FILE` reads them.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from omegaconf import DictConfig

from specpipe.paths import display_path
from specpipe.training.resumable import SCORED_SHARE_RULE, check_output_file, check_task_settings, progress_bar
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.draft.medusa import MedusaDrafter
from specpipe.stages.tree.calibration import best_size, count_paths, heads_sha256, ranked_paths, write_calibration
from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint
from specpipe.paths import local_path, package_path
from specpipe.tasks import task_command
from specpipe.training.examples import Example, read_task_corpus, split_held_out

TABLE_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def _log(message: str) -> None:
    print(f"calibrate_tree: {message}", file=sys.stderr, flush=True)


def example_ranks(drafter, target, example: Example) -> torch.Tensor:
    """[n, K] ranks of the target's continuation among the heads' guesses at each answer position p of
    `example` (the root, token p + 1, is an answer token, and the K tokens after it are known)."""
    heads = len(drafter.heads)
    sequence = np.concatenate([example.tokens, example.answer[example.n_pred - 1:]])  # prompt + whole answer
    positions = np.arange(example.prompt_len - 1, min(len(example.tokens), len(sequence) - heads - 1))  # [n]
    if not len(positions):
        return torch.zeros(0, heads, dtype=torch.long)
    out = target.prefill(example.tokens.tolist(), target.new_cache())  # hidden [len(tokens), hidden]
    following = torch.from_numpy(np.stack([sequence[positions + 1 + j] for j in range(heads + 1)], axis=1))
    return drafter.true_path_ranks(out.hidden[torch.from_numpy(positions)], following)  # [n, K]


def run_calibrate_tree(cfg: DictConfig) -> dict:
    c = cfg.calibrate_tree
    check_task_settings(c, "calibrate_tree", {**SCORED_SHARE_RULE,
                                              "answers": (lambda v: v >= 0, ">= 0 (0: every held-out answer)")})
    if int(c.max_rank) < 1 or int(c.paths) < 1:
        raise ConfigError(f"calibrate_tree.max_rank and calibrate_tree.paths must be >= 1, got {c.max_rank} "
                          f"and {c.paths}")
    pipeline = build_pipeline(cfg)
    drafter = next((d for d in pipeline.decoder.drafters if isinstance(d, MedusaDrafter)), None)
    if drafter is None:
        raise ConfigError(f"task=calibrate_tree calibrates Medusa or Hydra heads: pipeline={cfg.pipeline.name} has "
                          f"none under pipeline.drafters (use pipeline=medusa or pipeline=hydra)")
    if c.get("out"):
        out = package_path(c.out)
    elif drafter.folder is not None:
        out = drafter.folder / "tree.json"
    else:
        raise ConfigError("calibrate_tree.out: where to write the tree (the drafter has no checkpoint folder)")
    check_output_file(out, "calibrate_tree.out", "tree.json")
    target, tokenizer = pipeline.decoder.target, pipeline.tokenizer
    corpus = local_path(c.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    examples, _ = read_task_corpus(corpus, "calibrate_tree.corpus", tokenizer, fingerprint["vocab_sha256"],
                                   cfg.model.name, int(c.max_seq_len), cfg.get("system_prompt"))
    _, held_out = split_held_out(examples, float(c.eval_fraction))
    if c.get("answers"):
        held_out = held_out[: int(c.answers)]
    if not held_out:
        raise ConfigError(f"the corpus {corpus} holds no held-out answers at eval_fraction={c.eval_fraction}")
    _log(f"{drafter.name}: {len(drafter.heads)} heads; {len(held_out)} held-out answers of {corpus}")

    bar = progress_bar(bool(c.progress), total=len(held_out), unit="answer", desc="calibrate")
    ranks = []
    for example in held_out:
        ranks.append(example_ranks(drafter, target, example))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ranks = torch.cat(ranks)  # [positions, K]
    paths, probabilities = ranked_paths(count_paths(ranks, int(c.max_rank)), len(ranks), int(c.paths))

    folder = drafter.folder
    info = {
        "drafter": drafter.name, "heads": display_path(folder) if folder is not None else None, "heads_sha256": heads_sha256(folder),
        "target": cfg.model.name, "dtype": str(cfg.model.dtype), "command": task_command("calibrate_tree"),
        "corpus": {"file": str(c.corpus), "sha256": sha256_file(corpus), "held_out_answers": len(held_out),
                   "eval_fraction": float(c.eval_fraction)},
        "positions": len(ranks), "max_rank": int(c.max_rank),
    }
    write_calibration(out, paths, probabilities, info)

    cost = pipeline.decoder.tree_builder.cost_curve
    chosen = best_size(probabilities, cost)
    cumulative = np.cumsum(probabilities)
    print(f"{drafter.name} on {len(ranks)} held-out answer positions: expected tokens per step by tree size "
          f"(the most likely paths), and per millisecond against a plain step on the cost curve")
    print("| nodes | expected accepted | vs a plain step |\n|---:|---:|---:|")
    for size in [s for s in TABLE_SIZES if s <= len(paths)] + ([chosen] if chosen not in TABLE_SIZES else []):
        expected = 1.0 + float(cumulative[size - 1]) if size else 1.0
        marker = " (chosen)" if size == chosen else ""
        print(f"| {size}{marker} | {expected:.3f} | {expected * cost(1) / cost(size + 1):.2f}x |")
    print(f"wrote {len(paths)} paths to {out}")
    return {"out": str(out), "paths": paths, "probabilities": probabilities, "positions": len(ranks), "chosen": chosen}
