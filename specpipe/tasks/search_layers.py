"""`task=search_layers`: which of the target's layers `drafter=layer_skip` should keep.

Runs specpipe.distill.layer_search's backward elimination on held-out answers of the
self-distilled corpus (the same split `task=distill_draft` holds out), prints the best-found set
and its top-1 agreement with the target for every size beside early exit (the first k layers),
and writes them to `search_layers.out` (JSON; `drafter=layer_skip drafter.layers=searched
drafter.keep=K` reads it) and a plot into the run's output folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from specpipe.distill.corpus import write_atomically
from specpipe.distill.layer_search import (AgreementProbe, ProbeSequence, agreement_interval, backward_elimination,
                                           elimination_forwards)
from specpipe.pipelines.builder import load_model
from specpipe.stages.draft.draft_vocab import pinned_vocab_path, write_ranking
from specpipe.stages.draft.layer_search_file import FORMAT, searched_layers_path
from specpipe.stages.draft.reduced_vocab import corpus_ranking
from specpipe.stores.manifest import sha256_file, tokenizer_fingerprint
from specpipe.training.resumable import SCORED_SHARE_RULE, check_output_file, check_task_settings
from specpipe.paths import local_path, package_path
from specpipe.tasks import task_command
from specpipe.training.examples import read_task_corpus, split_held_out


def _log(message: str) -> None:
    print(f"search_layers: {message}", file=sys.stderr, flush=True)


def probe_sequences(examples, positions: int) -> list[ProbeSequence]:
    """Teacher-forced sequences holding `positions` answer positions in all (the last one cut short)."""
    sequences, left = [], positions
    for example in examples:
        if left <= 0:
            break
        count = min(example.n_pred, left)
        ids = torch.from_numpy(example.tokens[: example.prompt_len - 1 + count])  # [T]
        scored = torch.arange(example.prompt_len - 1, example.prompt_len - 1 + count)  # [count]
        sequences.append(ProbeSequence(ids, scored, torch.from_numpy(example.answer[:count])))
        left -= count
    return sequences


def _plot(rows: list[dict], out: Path, model_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    kept = [row["kept"] for row in rows]
    figure, axes = plt.subplots(figsize=(6.5, 4))
    axes.plot(kept, [row["agreement"] for row in rows], marker="o", label="searched (backward elimination)")
    axes.plot(kept, [row["early_exit_agreement"] for row in rows], marker="s", label="early exit (first k layers)")
    axes.set_xlabel("target layers kept")
    axes.set_ylabel("top-1 agreement with the target")
    axes.set_title(f"{model_name}: self-draft layer subsets, held-out answers")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def run_search_layers(cfg: DictConfig) -> dict:
    s = cfg.search_layers
    check_task_settings(s, "search_layers", SCORED_SHARE_RULE)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    loaded = load_model(cfg.model)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    out = package_path(s.out) if s.get("out") else searched_layers_path(loaded.name)
    check_output_file(out, "search_layers.out", searched_layers_path(loaded.name).name)
    corpus = local_path(s.corpus)
    fingerprint = tokenizer_fingerprint(tokenizer)
    examples, _ = read_task_corpus(corpus, "search_layers.corpus", tokenizer, fingerprint["vocab_sha256"], loaded.name,
                                   int(s.max_seq_len), cfg.get("system_prompt"))
    _, examples = split_held_out(examples, float(s.eval_fraction))  # the search scores held-out answers only
    sequences = probe_sequences(examples, int(s.positions))
    ranking = corpus_ranking(str(corpus), tokenizer)
    vocab_ids = None
    if int(s.vocab_top_k):
        vocab_ids, _ = ranking.top(int(s.vocab_top_k), f"search_layers.vocab_top_k={s.vocab_top_k}")
    probe = AgreementProbe(model, sequences, vocab_ids)
    min_layers = int(s.min_layers)
    _log(f"{probe.positions} held-out answer positions in {len(sequences)} answers of {corpus.name}; "
         f"{probe.layer_count} layers down to {min_layers}; top-1 over "
         f"{'all' if vocab_ids is None else len(vocab_ids)} tokens; model dtype {model.dtype}")

    bar = None
    if bool(s.progress):
        from tqdm import tqdm

        bar = tqdm(total=elimination_forwards(probe.layer_count, min_layers, len(sequences)), unit="fwd",
                   desc="search", mininterval=1.0 if sys.stderr.isatty() else 60.0)
    try:
        searched = backward_elimination(probe, min_layers, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for row in searched:
        kept = len(row.layers)
        # The first `kept` layers: already scored when the search kept exactly those.
        early = row.agreement if row.layers == tuple(range(kept)) else probe.agreement(list(range(kept)))
        rows.append({"kept": kept, "layers": list(row.layers), "agreement": row.agreement, "dropped": row.dropped,
                     "early_exit_agreement": early})
    half_width = max(agreement_interval(r["agreement"], probe.positions) for r in rows)
    print(f"\n### Layer search for drafter=layer_skip: {loaded.name}, {probe.positions} held-out answer positions "
          f"(95% interval about +-{half_width:.3f})\n")
    print("| kept | searched agreement | early exit agreement | dropped | layers kept |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['kept']} | {r['agreement']:.3f} | {r['early_exit_agreement']:.3f} | "
              f"{'' if r['dropped'] is None else r['dropped']} | {r['layers']} |")

    result = {"format": FORMAT, "format_version": 1, "model": loaded.name, "tokenizer": fingerprint,
              "dtype": str(model.dtype).removeprefix("torch."), "command": task_command("search_layers"),
              "corpus": {"file": str(s.corpus), "sha256": sha256_file(corpus), "eval_fraction": float(s.eval_fraction)},
              "positions": probe.positions, "answers": len(sequences),
              "vocab_top_k": int(s.vocab_top_k), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1) + "\n"))
    # drafter=layer_skip drafts over the tokens of this corpus's ranking, pinned beside the search.
    write_ranking(pinned_vocab_path(out), ranking)
    _log(f"wrote {out} and {pinned_vocab_path(out).name}")
    from hydra.core.hydra_config import HydraConfig

    folder = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else out.parent
    _plot(rows, folder / "layer_search.png", loaded.name)
    _log(f"plot: {folder / 'layer_search.png'}")
    return result
