"""A prompt source written by the target itself: user turns sampled after the chat template's user header.

An instruction-tuned model given its chat template up to the start of a user turn, and nothing
else, writes a user's request (Magpie, Xu et al. 2024). The requests follow the chat data the model
was tuned on, so they vary the way real requests do, where the template x subject source of
`specpipe.distill.prompts` repeats a few hundred forms, which the heads trained on that source fit.

Sampling runs in seeded batches (batch b draws under the seed `seed + b`) appended to a JSONL file
beside the corpus shards, so a killed run resumes at the first batch the file lacks and a finished
one is read back, never sampled again. A turn is kept when the model ended it itself within
`max_new_tokens`, has at least `min_words` words, is not a duplicate (normalised text) of an earlier
one, and is no exact or near duplicate of a dev prompt (`find_overlaps`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.distill.dev_overlap import dev_prompt_files, find_overlaps, load_dev_turns, normalise
from specpipe.paths import display_path
from specpipe.distill.prompts import ChatPrompt, PromptSource, prompt_id
from specpipe.errors import ConfigError

CATEGORY = SOURCE = "magpie"
QUERIES_FILE = "magpie_queries.jsonl"
_USER_MARK = "\x00specpipe user turn\x00"


@dataclass(frozen=True)
class MagpieSettings:
    batches: int = 60          # batches of user turns sampled
    batch_size: int = 48
    max_new_tokens: int = 64   # a user turn longer than this is dropped (it did not end)
    temperature: float = 1.0
    min_words: int = 5
    seed: int = 20261129

    def __post_init__(self) -> None:
        for key in ("batches", "batch_size", "max_new_tokens", "min_words"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"distill.magpie.{key} must be >= 1, got {getattr(self, key)}")
        if not float(self.temperature) > 0:
            raise ConfigError(f"distill.magpie.temperature must be > 0 (user turns are sampled), got {self.temperature}")


def user_header_ids(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None) -> list[int]:
    """The chat as the Pipeline encodes it, up to where the user's text would start."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("distill.prompt_source=magpie samples user turns after the chat template's user header; "
                          "this tokenizer has no chat template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": _USER_MARK}], tokenize=False)
    return tokenizer(text.split(_USER_MARK)[0], add_special_tokens=False)["input_ids"]


def turn_end_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a turn: the generation config's EOS ids and the tokenizer's."""
    ends = model.generation_config.eos_token_id
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    if tokenizer.eos_token_id is not None:
        ends.append(int(tokenizer.eos_token_id))
    if not ends:
        raise ConfigError("distill.prompt_source=magpie: the model has no EOS token to end a sampled user turn")
    return sorted(set(ends))


class MagpieSampler:
    """Samples user turns from `model` in seeded batches into `path` (JSONL, one row per turn)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
                 settings: MagpieSettings, path: Path) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.path = path
        self.header = torch.tensor([user_header_ids(tokenizer, system_prompt)])  # [1, h]
        self.ends = turn_end_ids(model, tokenizer)
        # what decides a batch's turns: a file sampled otherwise would mix two sources (`batches` may grow,
        # `min_words` only filters)
        self.sampled_with = {"batch_size": settings.batch_size, "max_new_tokens": settings.max_new_tokens,
                             "temperature": float(settings.temperature), "seed": settings.seed,
                             "header_ids": self.header[0].tolist()}

    def rows(self) -> list[dict]:
        """The turns sampled so far, in file order (none without a file); a damaged line is refused by number."""
        if not self.path.is_file():
            return []
        rows = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                row = json.loads(line)
                rows.append({"batch": int(row["batch"]), "finished": bool(row["finished"]), "text": str(row["text"])})
            except (ValueError, KeyError, TypeError) as error:
                raise ConfigError(f"{self.path}:{number}: not a sampled user turn ({error}); delete the file to "
                                  f"sample again") from error
        return rows

    def sample(self, progress: bool = True) -> None:
        """Samples every batch the file lacks; each batch is appended whole, so a killed run loses at most one."""
        self.check_sampled_with()
        done = {row["batch"] for row in self.rows()}
        todo = [b for b in range(self.settings.batches) if b not in done]
        if not todo:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.with_suffix(".json").write_text(json.dumps(self.sampled_with, indent=1))
        started = time.perf_counter()
        for position, batch in enumerate(todo, start=1):
            rows = self._sample_batch(batch)
            with self.path.open("a", encoding="utf-8") as out:
                out.write("".join(json.dumps(row) + "\n" for row in rows))
            if progress:
                print(f"magpie: batch {batch} ({position}/{len(todo)}), {sum(r['finished'] for r in rows)} of "
                      f"{len(rows)} turns ended, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    def check_sampled_with(self) -> None:
        """Refuses a turns file sampled under other settings (ConfigError naming them)."""
        pinned_path = self.path.with_suffix(".json")
        if not pinned_path.is_file():
            return
        pinned = json.loads(pinned_path.read_text(encoding="utf-8"))
        differing = [key for key, value in self.sampled_with.items() if pinned.get(key) != value]
        if differing:
            what = "the system prompt or chat template" if differing == ["header_ids"] else ", ".join(differing)
            raise ConfigError(f"{self.path} was sampled with other settings ({what} differ): keep them, or give "
                              f"this source another distill.shards folder")

    @torch.inference_mode()
    def _sample_batch(self, batch: int) -> list[dict]:
        s = self.settings
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(s.seed + batch)
        try:
            ids = self.header.repeat(s.batch_size, 1)  # [b, h]
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=float(s.temperature), top_p=1.0, top_k=0,
                                      max_new_tokens=s.max_new_tokens, eos_token_id=self.ends,
                                      pad_token_id=self.ends[0])  # [b, h + new]
        finally:
            torch.random.set_rng_state(generator_state)
        rows = []
        for turn in out[:, ids.shape[1]:].tolist():
            end = next((i for i, token in enumerate(turn) if token in self.ends), None)
            text = self.tokenizer.decode(turn if end is None else turn[:end], skip_special_tokens=True).strip()
            rows.append({"batch": batch, "finished": end is not None, "text": text})
        return rows

    def source(self, dev_files: list[Path] | None = None) -> PromptSource:
        """The kept turns as first-turn prompts (file order), without duplicates or dev overlaps."""
        self.check_sampled_with()
        dev_files = dev_prompt_files() if dev_files is None else list(dev_files)
        kept, seen = [], set()
        for row in self.rows():
            if row["batch"] >= self.settings.batches:
                continue  # a file sampled for more batches serves a smaller setting
            text, key = row["text"], normalise(row["text"])
            if row["finished"] and len(text.split()) >= self.settings.min_words and key not in seen:
                seen.add(key)
                kept.append(text)
        dropped = find_overlaps(kept, load_dev_turns(dev_files))
        overlapping = {text for text, _, _ in dropped}
        prompts = [ChatPrompt(prompt_id(text), CATEGORY, SOURCE, text) for text in kept if text not in overlapping]
        return PromptSource(prompts, dropped, [display_path(path) for path in dev_files], self.settings.seed)
