"""A head's run, whatever its kind: the kinds by name, the reduced vocabulary a head trains and drafts over
(and the ranking exported beside it), the inputs every kind reads, the eval of a head trained elsewhere
(train_heads.eval_of), and `HeadRun`, the scaffold's run with a head kind's eval and export in the released
layout (config.json's `specpipe` entry records the corpus, the training and the eval)."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from specpipe.training.resumable import frozen_product, write_json
from specpipe.errors import ConfigError
from specpipe.stages.draft.draft_vocab import VOCAB_FILE, TokenRanking, pinned_vocab_path, read_ranking
from specpipe.stages.draft.eagle import frequent_ids
from specpipe.stages.draft.eagle3 import build_eagle3_net
from specpipe.stages.draft.eagle_checkpoint import read_eagle_net
from specpipe.stages.draft.head_checkpoint import check_tokenizer, read_checkpoint
from specpipe.stages.draft.medusa import build_medusa_heads
from specpipe.stages.draft.reduced_vocab import corpus_ranking, output_weight
from specpipe.training.eagle import EAGLE
from specpipe.training.eagle3 import EAGLE3
from specpipe.training.examples import Example
from specpipe.training.heads import HeadInputs, HeadKind, HeadSettings, HeadTrainer, HeadWindow, format_eval
from specpipe.training.medusa import HYDRA, MEDUSA
from specpipe.training.scaffold import CorpusSplit, Records, Schedule, TrainingRun

KINDS: dict[str, HeadKind] = {"eagle": EAGLE, "medusa": MEDUSA, "eagle3": EAGLE3, "hydra": HYDRA}
EVAL_KEYS = ("top1", "vocab_miss_rate", "loss", "acceptance_per_depth", "mean_accepted_per_chain", "chains",
             "positions")


def trained_head(kind: str, path: Path, target, tokenizer, top_k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """train_heads.eval_of: the trained head(s) of `kind` in directory `path`, in fp32, and the token
    ids [K] they draft over in the pipeline: EAGLE-3's own draft vocabulary, else the `top_k` most
    frequent tokens of the ranking pinned beside the head (the shipped chat corpus's where none is),
    as drafter.vocab_top_k=top_k drafts."""
    option = "train_heads.eval_of"
    if not path.is_dir():
        raise ConfigError(f"{option}={path} is not a directory: give the folder of a head that "
                          f"`task=train_heads train_heads.kind={kind}` exported (e.g. data/{kind}/smollm2_135m)")
    config = target.config
    vocab = int(config.vocab_size)
    if kind == "eagle":
        net = read_eagle_net(path, tokenizer, int(config.hidden_size), vocab, option).float()
    else:
        what = "EAGLE-3 head" if kind == "eagle3" else "Medusa checkpoint"
        checkpoint, tensors = read_checkpoint(path, option, what, layout=kind)
        check_tokenizer(checkpoint, tokenizer, path, option)
        if kind == "eagle3":
            net = build_eagle3_net(checkpoint, tensors, config, option).float()
            return net, net.target_ids()
        net = build_medusa_heads(checkpoint, tensors, config, option).float()
        if net.own_outputs():
            raise ConfigError(f"{option}={path}: these Medusa heads carry their own output layers; the eval "
                              f"scores heads that share the target's (as train_heads trains them)")
    ids = frequent_ids(tokenizer, vocab, 0 if top_k == vocab else top_k, None, option, pinned_vocab_path(path))
    return net, torch.arange(vocab) if ids is None else ids


def head_ranking(corpus: Path, start: Path | None, tokenizer, vocab: int) -> TokenRanking:
    """The ranking of draft tokens exported beside a new head: the corpus's. A fine-tune (from the head in
    `start`) keeps its start's: it drafts what its start did, and a small fine-tuning corpus would rank the
    vocabulary on too few answers."""
    start_ranking = start / VOCAB_FILE if start is not None else None
    if start_ranking is not None and start_ranking.is_file():
        return read_ranking(start_ranking, tokenizer, vocab, "train_heads.init_from")
    return corpus_ranking(str(corpus), tokenizer)


def head_inputs(target, features: dict[str, np.ndarray], aux_features: dict[str, np.ndarray] | None,
                aux_layers: tuple[int, ...], reduced_ids: torch.Tensor, pad_id: int) -> HeadInputs:
    """The inputs of every kind: the target's frozen embedding, and its frozen output layer over `reduced_ids`."""
    embed = target.get_input_embeddings()
    embed.requires_grad_(False)
    vocab = int(target.config.vocab_size)
    to_reduced = torch.full((vocab,), -1, dtype=torch.long)
    to_reduced[reduced_ids] = torch.arange(len(reduced_ids))
    # rows [n, H] -> [n, K]: the target's frozen output layer over the reduced vocabulary
    reduced_head = frozen_product(output_weight(target, "train_heads").detach().float()[reduced_ids])
    return HeadInputs(features, aux_features, tuple(aux_layers), embed, reduced_head, reduced_ids, to_reduced, pad_id)


def evaluate_timed(kind: HeadKind, net: torch.nn.Module, inputs: HeadInputs, examples: list[Example],
                   settings: HeadSettings) -> dict:
    started = time.perf_counter()
    result = kind.evaluate(net, inputs, examples, settings)
    result["eval_seconds"] = round(time.perf_counter() - started, 1)
    return result


def evaluate_trained(net: torch.nn.Module, path: Path, inputs: HeadInputs, held_out: list[Example],
                     settings: HeadSettings, folder: Path, dtype: str, command: str, report_settings: dict,
                     log) -> dict:
    """train_heads.eval_of: the eval of the head(s) in `path` on this split, logged and written to
    `folder/eval-of-<kind>-<dtype>-<hash of path>.json`; nothing trained, nothing exported."""
    result = {"head": str(path), **evaluate_timed(KINDS[settings.kind], net, inputs, held_out, settings)}
    log(format_eval(result, f"eval of {result['head']}"))
    digest = hashlib.sha256(result["head"].encode()).hexdigest()[:8]
    report_path = folder / f"eval-of-{settings.kind}-{dtype}-{digest}.json"
    write_json(report_path, {**result, "command": command, "settings": report_settings})
    return {"eval": result, "report": str(report_path)}


class HeadRun(TrainingRun):
    """The training run of `net`, a head of `settings.kind`: its evals, and its exports to `out` in the released
    layout (with `ranking`, the draft tokens, beside all but EAGLE-3, which carries its own vocabulary)."""

    def __init__(self, net: torch.nn.Module, inputs: HeadInputs, settings: HeadSettings, ranking: TokenRanking,
                 trainer: HeadTrainer, schedule: Schedule, split: CorpusSplit, out: Path, records: Records,
                 log) -> None:
        super().__init__(trainer, "train_heads", schedule, split, out, records, HeadWindow(), log)
        self.kind, self.net, self.inputs, self.settings = KINDS[settings.kind], net, inputs, settings
        self.ranking = ranking

    def evaluate(self) -> dict:
        return evaluate_timed(self.kind, self.net, self.inputs, self.split.held_out, self.settings)

    def describe(self, result: dict) -> str:
        return format_eval(result, f"eval at step {result['step']}")

    def export(self, result: dict) -> None:
        pinned = {"ranking": self.ranking} if self.kind.pins_ranking else {}
        record = self.export_record(result, self.kind.loss_text(self.settings), EVAL_KEYS)
        self.kind.save(self.net, self.out, record, **pinned)
        self.log(f"exported the {self.settings.kind} head(s) at step {self.trainer.step} to {self.out}")

    def exported_current(self) -> bool:
        config = self.out / "config.json"
        exported = {}
        if config.is_file():
            exported = (json.loads(config.read_text()).get("specpipe") or {}).get("training", {})
        return exported.get("steps") == self.trainer.step
