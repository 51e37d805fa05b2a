"""The corpus answers as the training tasks read them: one `Example` per answer (prompt + answer token ids
cut to a length), the held-out split by a hash of the prompt id (so it never depends on corpus order and every
task holds out the same answers), batches packed by padded length, and `fill_shards`, which computes
per-example arrays (teacher logits, target features) batch by batch into resumable shards."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpipe.distill.corpus import chat_prompt_ids, check_corpus_tokenizer, read_corpus, read_corpus_metadata
from specpipe.distill.prompts import prompt_id as text_id
from specpipe.training.resumable import ExampleShards, progress_bar, token_batches
from specpipe.errors import ConfigError


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
