"""Scores draft models on one held-out split, with the eval `task=distill_draft` runs after training.

Each training run scores its draft on its own split (the hash-held-out answers of the corpus it read),
so two drafts trained on different corpora are not compared by their sidecars. This scores any
number of drafts on the split of one run: its corpus and `limit`, and the teacher logits that run
cached in its checkpoint folder (every held-out answer must be there: run the task first, with
`distill_draft.teacher_only=true` if only the split is wanted).

    python bench/draft_eval.py --checkpoint-dir ~/.cache/specpipe/distill_draft/smollm2_135m \\
        data/draft/smollm2_135m_draft.safetensors other_draft.safetensors [distill_draft.limit=5120 ...]

Trailing KEY=VALUE arguments are config overrides, as the task takes them (the corpus, `limit`,
`eval_fraction`, `eval_chains`, ...); they must match the run whose teacher cache is read.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specpipe.distill.draft_model import load_draft
from specpipe.paths import local_path
from specpipe.pipelines.builder import compose_config, load_model
from specpipe.stores.manifest import tokenizer_fingerprint
from specpipe.training.draft import TeacherCache, evaluate
from specpipe.training.examples import pad_id_of, read_task_corpus, split_held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True, type=Path,
                        help="a distill_draft checkpoint folder (its teacher/ holds the held-out answers' logits)")
    parser.add_argument("drafts", nargs="+", help="draft .safetensors files, then KEY=VALUE config overrides")
    args = parser.parse_args()
    drafts = [d for d in args.drafts if "=" not in d]
    cfg = compose_config(["task=distill_draft", *[d for d in args.drafts if "=" in d]])
    d = cfg.distill_draft
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    loaded = load_model(cfg.model)
    vocab_sha256 = tokenizer_fingerprint(loaded.tokenizer)["vocab_sha256"]
    examples, _ = read_task_corpus(local_path(d.corpus), "distill_draft.corpus", loaded.tokenizer, vocab_sha256,
                                   loaded.name, int(d.max_seq_len), cfg.get("system_prompt"))
    if d.get("limit"):
        examples = examples[: int(d.limit)]
    _, held_out = split_held_out(examples, float(d.eval_fraction))
    teacher = TeacherCache(args.checkpoint_dir.expanduser() / "teacher").load()
    missing = [e.prompt_id for e in held_out if e.prompt_id not in teacher]
    if missing:
        raise SystemExit(f"{len(missing)} of {len(held_out)} held-out answers have no teacher logits in "
                         f"{args.checkpoint_dir}: run task=distill_draft there first (teacher_only=true)")
    pad_id = pad_id_of(loaded.tokenizer)
    depth = int(d.chain_depth)
    print(f"{len(held_out)} held-out answers ({sum(e.n_pred for e in held_out)} positions) of {d.corpus}"
          f"{f' (first {d.limit})' if d.get('limit') else ''}; {d.eval_chains} chains of {depth}\n")
    print("| draft | top-1 (teacher) | KL | acceptance per depth | accepted per chain |")
    print("|---|---:|---:|---|---:|")
    for path in drafts:
        result = evaluate(load_draft(loaded.model, loaded.tokenizer, path), held_out, teacher, d, pad_id, False)
        per_depth = " / ".join(f"{value:.3f}" for value in result["acceptance_per_depth"].values())
        print(f"| `{path}` | {result['top1_teacher']:.4f} | {result['kl']:.4f} | {per_depth} | "
              f"{result['mean_accepted_per_chain']:.3f} of {depth} |")


if __name__ == "__main__":
    main()
