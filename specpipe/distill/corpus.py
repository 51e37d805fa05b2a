"""Self-distilled chat corpus: the target's greedy answers to the prompt source, generated in
batches, written as resumable Parquet shards, merged into the file the repository ships.

- `BatchedGreedy` answers a batch of prompts with HF `generate` (chat template as the Pipeline
  applies it, left padding, greedy); `specpipe.distill.continuous.ContinuousGreedy` answers a
  stream of prompts with continuous batching (the default: 1.4x faster here, same answers).
- `ShardFolder` holds the shards: one Parquet file per batch, each written to a temporary name
  and renamed, so a run killed at any moment leaves only whole shards; the prompts they hold are
  skipped when the run starts again. `run.json` pins the generation settings: a resume with other
  settings is refused instead of mixing two corpora.
- `distill` drives the two; `shards_from_corpus` restarts an empty shard folder from a merged
  file, so a run extends the shipped corpus; `merge_shards` concatenates the shards, in prompt-source order and
  restricted to the current prompt source, into one zstd Parquet file with its metadata.

The command (see specpipe/tasks/distill_corpus.py) is `python run.py task=distill_corpus`.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.distill.prompts import ChatPrompt
from specpipe.errors import ConfigError, SpecpipeError

SHARD_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("category", pa.string()),
    ("prompt", pa.string()),
    ("answer_ids", pa.list_(pa.int32())),  # generated ids, through the EOS token when one was generated
    ("answer", pa.string()),                # answer_ids decoded without special tokens
    ("finished", pa.bool_()),               # True: ended with EOS; False: cut at max_new_tokens
    ("history", pa.list_(pa.string())),     # the turns before `prompt` (user, assistant, ...); empty: a first turn
])
MERGED_COLUMNS = ["prompt_id", "category", "prompt", "answer_ids", "finished", "history"]
METADATA_KEY = b"specpipe.self_distill"
RUN_FILE = "run.json"     # the generation settings every shard was made with
RUNS_FILE = "runs.jsonl"  # one line per generation run


class CorpusError(SpecpipeError):
    """A shard folder or corpus file that cannot be used as asked."""


@dataclass(frozen=True)
class Answer:
    prompt: ChatPrompt
    answer_ids: list[int]
    answer: str
    finished: bool


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, system_prompt: str | None = None,
                    history: Sequence[str] = ()) -> list[int]:
    """Prompt ids exactly as `Pipeline.encode` builds them for a chat whose earlier turns are
    `history` (user, assistant, ...: the benchmark carries each answer's text into the next turn),
    so the corpus holds the answers the target gives at benchmark time."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": turn} for i, turn in enumerate(history)]
    messages.append({"role": "user", "content": text})
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def eos_and_pad_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], int]:
    """(the tokens that end an answer, the token that pads a batch row)."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    eos_token_ids = sorted({e for e in [*eos, tokenizer.eos_token_id] if e is not None})
    if not eos_token_ids:
        raise CorpusError("the model has no EOS token: answers could never end before max_new_tokens")
    pad = tokenizer.pad_token_id
    return eos_token_ids, int(pad if pad is not None else eos_token_ids[0])


class BatchedGreedy:
    """Greedy answers for a batch of prompts in one left-padded HF `generate` call.

    Left padding keeps every prompt's last token in the last column, where generation continues;
    the attention mask hides the padding and `generate` derives position ids from it, so each row
    is decoded as if alone (up to float rounding of the wider products; see the tests).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 system_prompt: str | None = None, batch_size: int = 16) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.system_prompt = system_prompt
        self.batch_size = int(batch_size)
        self.eos_token_ids, self.pad_token_id = eos_and_pad_ids(model, tokenizer)

    def encode(self, prompt: ChatPrompt) -> list[int]:
        return chat_prompt_ids(self.tokenizer, prompt.text, self.system_prompt, prompt.history)

    def stream(self, prompts: Sequence[ChatPrompt], encoded: Sequence[list[int]] | None = None) -> Iterator[Answer]:
        """One Answer per prompt: batches of similar prompt lengths, each answered in one call."""
        encoded = [self.encode(p) for p in prompts] if encoded is None else encoded
        for batch in length_sorted_batches(prompts, [len(ids) for ids in encoded], self.batch_size):
            yield from self.answer([prompts[i] for i in batch], [encoded[i] for i in batch])

    def answer(self, prompts: Sequence[ChatPrompt], encoded: Sequence[list[int]] | None = None) -> list[Answer]:
        encoded = [self.encode(p) for p in prompts] if encoded is None else encoded
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_token_id, dtype=torch.long)  # [b, width]
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)               # [b, width]
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=self.max_new_tokens,
                min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=self.eos_token_ids,
                pad_token_id=self.pad_token_id, temperature=None, top_p=None, top_k=None)
        answers = []
        eos = set(self.eos_token_ids)
        for prompt, row in zip(prompts, output[:, width:].tolist()):
            end = next((i + 1 for i, token in enumerate(row) if token in eos), None)
            ids = row[:end] if end is not None else row
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            answers.append(Answer(prompt, ids, text, end is not None))
        return answers


def length_sorted_batches(prompts: Sequence[ChatPrompt], lengths: Sequence[int], batch_size: int,
                          window: int = 8) -> Iterator[list[int]]:
    """Indices of `prompts` in batches: each window of `window` batches in source order is sorted
    by prompt length first, so a batch pads little while the run still walks the (shuffled,
    category-balanced) source order."""
    span = batch_size * window
    for start in range(0, len(prompts), span):
        chunk = sorted(range(start, min(start + span, len(prompts))), key=lambda i: (lengths[i], i))
        for offset in range(0, len(chunk), batch_size):
            yield chunk[offset:offset + batch_size]


class ShardFolder:
    """A folder of `shard-NNNNNN.parquet` files, each holding whole answers (SHARD_SCHEMA)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def shard_paths(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.parquet"))

    def read(self, columns: Sequence[str] | None = None) -> pa.Table:
        tables = []
        for path in self.shard_paths():
            try:
                tables.append(pq.read_table(path, columns=list(columns) if columns else None, schema=SHARD_SCHEMA))
            except (pa.ArrowException, OSError) as error:
                raise CorpusError(f"shard {path} cannot be read ({error}); delete it and resume to regenerate "
                                  f"its answers") from None
        if not tables:
            return SHARD_SCHEMA.empty_table().select(list(columns) if columns else SHARD_SCHEMA.names)
        return with_history(pa.concat_tables(tables))

    def done(self) -> dict[str, int]:
        """Answer-token count of every prompt answered so far, by prompt id."""
        table = self.read(["prompt_id", "answer_ids"])
        lengths = pc.list_value_length(table.column("answer_ids")).to_pylist()
        return dict(zip(table.column("prompt_id").to_pylist(), lengths))

    def answers_to(self, prompts: Sequence[ChatPrompt]) -> list[tuple[ChatPrompt, str]]:
        """(prompt, its answer's text) for each of `prompts` answered in the shards, in `prompts` order."""
        table = self.read(["prompt_id", "answer"])
        answers = dict(zip(table.column("prompt_id").to_pylist(), table.column("answer").to_pylist()))
        return [(prompt, answers[prompt.prompt_id]) for prompt in prompts if prompt.prompt_id in answers]

    def write(self, answers: Sequence[Answer]) -> Path:
        """One new shard, atomically: a temporary file renamed into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        paths = self.shard_paths()
        index = int(paths[-1].stem.split("-")[1]) + 1 if paths else 0
        path = self.folder / f"shard-{index:06d}.parquet"
        table = pa.Table.from_pydict({
            "prompt_id": [a.prompt.prompt_id for a in answers],
            "category": [a.prompt.category for a in answers],
            "prompt": [a.prompt.text for a in answers],
            "answer_ids": [a.answer_ids for a in answers],
            "answer": [a.answer for a in answers],
            "finished": [a.finished for a in answers],
            "history": [list(a.prompt.history) for a in answers],
        }, schema=SHARD_SCHEMA)
        write_atomically(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
        return path

    def pin_settings(self, settings: dict) -> None:
        """Records the generation settings on the first run; refuses a resume with other ones."""
        path = self.folder / RUN_FILE
        if path.is_file():
            pinned = json.loads(path.read_text())
            differing = {key: (pinned.get(key), value) for key, value in settings.items() if pinned.get(key) != value}
            if differing and self.shard_paths():
                details = "; ".join(f"{key}: shards have {old!r}, now {new!r}" for key, (old, new) in differing.items())
                raise CorpusError(f"the shards in {self.folder} were generated with other settings ({details}). "
                                  f"Resume with the same settings, or write to another shards folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(settings, indent=1, sort_keys=True)))

    def settings(self) -> dict:
        path = self.folder / RUN_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    def log_run(self, record: dict) -> None:
        """Appends one run's summary to `runs.jsonl` (provenance for the merged file)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}  # a carried run keeps its time
        with open(self.folder / RUNS_FILE, "a", encoding="utf-8") as log:
            log.write(json.dumps(record, sort_keys=True) + "\n")

    def runs(self) -> list[dict]:
        path = self.folder / RUNS_FILE
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def remove_partial(self) -> None:
        """Temporary files of a run that was killed mid-write."""
        for path in self.folder.glob(".tmp-*"):
            path.unlink(missing_ok=True)


def with_history(table: pa.Table) -> pa.Table:
    """`table` with its history column's nulls (shards and corpora made before it existed) as empty lists."""
    if "history" not in table.column_names:
        return table
    column = table.column("history")
    if not column.null_count:
        return table
    filled = pa.array([turns or [] for turns in column.to_pylist()], pa.list_(pa.string()))
    return table.set_column(table.column_names.index("history"), "history", filled)


def check_corpus_tokenizer(corpus: Path, metadata: dict, vocab_sha256: str, model_name: str) -> None:
    """Refuses a corpus whose metadata records another tokenizer than the model's (`vocab_sha256` of
    tokenizer_fingerprint); a corpus that records none is taken as it is."""
    if metadata.get("tokenizer", {}).get("vocab_sha256", vocab_sha256) != vocab_sha256:
        raise ConfigError(f"the corpus {corpus} holds token ids of another tokenizer than model={model_name}'s")


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Runs `write(temporary path)` beside `path`, then renames it over `path`: readers see the old
    file or the whole new one, never a part."""
    tmp = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}"
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class DistillStats:
    prompts_done: int = 0   # in the shards, before and during this run
    tokens_done: int = 0
    new_prompts: int = 0    # answered by this run
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class AnswerStream(Protocol):
    """What `distill` drives: BatchedGreedy (HF `generate` per padded batch) or ContinuousGreedy."""

    def encode(self, prompt: ChatPrompt) -> list[int]: ...

    def stream(self, prompts: Sequence[ChatPrompt], encoded: Sequence[list[int]]) -> Iterator[Answer]: ...


def distill(generator: AnswerStream, prompts: Sequence[ChatPrompt], shards: ShardFolder, batch_size: int,
            token_budget: int | None = None, progress: bool = True) -> DistillStats:
    """Answers every prompt not yet in `shards`, one shard per `batch_size` answers, until the shards
    hold `token_budget` answer tokens (None: until every prompt is answered). Answers in flight
    when the run stops (budget reached, killed) are not kept: a resume generates them again."""
    shards.remove_partial()
    done = shards.done()
    # Only answers to prompts of this source count: a prompt whose text changed since is not in the corpus.
    answered = [p for p in prompts if p.prompt_id in done]
    todo = [p for p in prompts if p.prompt_id not in done]
    stats = DistillStats(len(answered), sum(done[p.prompt_id] for p in answered))
    if token_budget is not None and stats.tokens_done >= token_budget or not todo:
        return stats
    encoded = [generator.encode(p) for p in todo]
    bar = _progress_bar(progress, stats, token_budget, len(prompts))
    started = time.perf_counter()
    pending: list[Answer] = []
    answers = generator.stream(todo, encoded)
    try:
        for position, answer in enumerate(answers, start=1):
            pending.append(answer)
            if len(pending) < batch_size and position < len(todo):
                continue
            shards.write(pending)
            new_tokens = sum(len(a.answer_ids) for a in pending)
            stats.new_prompts += len(pending)
            stats.new_tokens += new_tokens
            stats.prompts_done += len(pending)
            stats.tokens_done += new_tokens
            stats.seconds = time.perf_counter() - started
            if bar is not None:
                bar.update(new_tokens if token_budget is not None else len(pending))
                bar.set_postfix(prompts=stats.prompts_done, tokens=stats.tokens_done,
                                tok_s=f"{stats.tokens_per_second:.1f}", refresh=False)
            pending = []
            if token_budget is not None and stats.tokens_done >= token_budget:
                break
    finally:
        if hasattr(answers, "close"):
            answers.close()
        if bar is not None:
            bar.close()
    return stats


def _progress_bar(enabled: bool, stats: DistillStats, token_budget: int | None, prompt_count: int):
    if not enabled:
        return None
    from tqdm import tqdm

    # In a log file (nohup) a redraw every few seconds is noise: one line a minute is plenty.
    interval = 1.0 if sys.stderr.isatty() else 60.0
    if token_budget is not None:
        return tqdm(total=token_budget, initial=min(stats.tokens_done, token_budget), unit="tok",
                    desc="distill", mininterval=interval, dynamic_ncols=True)
    return tqdm(total=prompt_count, initial=stats.prompts_done, unit="prompt", desc="distill",
                mininterval=interval, dynamic_ncols=True)


# What makes two corpora's answers the same kind of answers (a merge may replace one with the other).
GENERATION_KEYS = ("model", "dtype", "linears", "max_new_tokens", "system_prompt", "tokenizer")


def merge_shards(shards: ShardFolder, out: Path, prompts: Sequence[ChatPrompt], metadata: dict,
                 replace: bool = False) -> dict:
    """Writes the answers in `shards` whose prompts are in `prompts` (in that order) to `out`
    (zstd Parquet, MERGED_COLUMNS) with `metadata` plus counts in the file's metadata and in a
    JSON sidecar `out.with_suffix('.json')`; both written atomically. Returns the sidecar dict.

    An existing corpus at `out` made with other generation settings, or holding more answers than the
    merge, is refused unless `replace`: its answers would be lost (the shards may not hold them)."""
    table = shards.read(MERGED_COLUMNS)
    order = {p.prompt_id: position for position, p in enumerate(prompts)}
    ids = table.column("prompt_id").to_pylist()
    rows: dict[str, int] = {}
    for row, pid in enumerate(ids):
        if pid in order and pid not in rows:  # a prompt answered twice keeps its first answer
            rows[pid] = row
    if not rows:
        raise CorpusError(f"no answers in {shards.folder} belong to the current prompt source: nothing to merge")
    keep = sorted(rows.values(), key=lambda row: order[ids[row]])
    merged = table.take(pa.array(keep, pa.int64()))
    if not replace:
        refuse_losing_answers(Path(out), metadata, merged.num_rows)
    lengths = pc.list_value_length(merged.column("answer_ids"))
    info = {
        **metadata,
        "answers": merged.num_rows,
        "answer_tokens": int(pc.sum(lengths).as_py()),
        "finished_with_eos": int(pc.sum(merged.column("finished").cast(pa.int64())).as_py()),
        "columns": MERGED_COLUMNS,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    merged = merged.replace_schema_metadata({METADATA_KEY: json.dumps(info, sort_keys=True).encode()})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda tmp: pq.write_table(merged, tmp, compression="zstd", compression_level=19))
    from specpipe.stores.manifest import sha256_file

    sidecar = {**info, "file": out.name, "bytes": out.stat().st_size, "sha256": sha256_file(out)}
    write_atomically(out.with_suffix(".json"),
                      lambda tmp: Path(tmp).write_text(json.dumps(sidecar, indent=1, sort_keys=True) + "\n"))
    return sidecar


def refuse_losing_answers(out: Path, metadata: dict, answers: int) -> None:
    """Raises CorpusError where writing `answers` answers made as `metadata` says over `out` would lose some."""
    if not out.exists():
        return
    try:
        existing = read_corpus_metadata(out)
    except CorpusError:
        raise CorpusError(f"distill.out={out} exists and is not a self-distilled corpus: give another distill.out, "
                          f"or move that file away") from None
    other = {key: (existing.get(key), metadata.get(key)) for key in GENERATION_KEYS
             if existing.get(key) != metadata.get(key)}
    if other:
        said = ", ".join(f"{key}={was!r} there, {now!r} here" for key, (was, now) in other.items())
        raise CorpusError(f"distill.out={out} holds {existing.get('answers', '?')} answers made with other settings "
                          f"({said}); merging would replace them. Give another distill.out, or set distill.replace=true")
    if int(existing.get("answers", 0)) > answers:
        raise CorpusError(f"distill.out={out} holds {existing['answers']} answers; the shards give {answers} for these "
                          f"prompts (distill.limit?), and merging would drop the rest. Give another distill.out, or set "
                          f"distill.replace=true")


def shards_from_corpus(shards: ShardFolder, corpus: Path, settings: dict,
                       tokenizer: PreTrainedTokenizerBase) -> int:
    """Turns a merged corpus file back into the first shard of an empty shard folder, so a run
    extends it (the repository ships the merged file, not the shards). Its generation runs are
    carried into `runs.jsonl`. Returns how many answers it holds; 0, leaving the folder as it is,
    when the folder has shards already or the file was made with other `settings`."""
    corpus = Path(corpus)
    if shards.shard_paths() or not corpus.is_file():
        return 0
    metadata = read_corpus_metadata(corpus)
    made_with = {**{key: metadata.get(key) for key in settings}, "seed": metadata.get("prompt_source", {}).get("seed")}
    if made_with != settings:
        return 0
    table = read_corpus(corpus)
    answer_ids = table.column("answer_ids").to_pylist()
    answers = table.append_column("answer", pa.array(
        [tokenizer.decode(ids, skip_special_tokens=True) for ids in answer_ids], pa.string()))
    shards.folder.mkdir(parents=True, exist_ok=True)
    shards.pin_settings(settings)
    for run in metadata.get("runs", []):
        shards.log_run(run)
    write_atomically(shards.folder / "shard-000000.parquet", lambda tmp: pq.write_table(
        answers.select(SHARD_SCHEMA.names).cast(SHARD_SCHEMA), tmp, compression="zstd"))
    return table.num_rows


def _corpus_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as error:
        raise CorpusError(f"{path} is not a readable Parquet file ({str(error).splitlines()[0]}): give a corpus "
                          f"written by `python run.py task=distill_corpus`") from None


def read_corpus(path: Path) -> pa.Table:
    """A merged corpus's MERGED_COLUMNS (a file made before the history column: all first turns)."""
    schema = _corpus_schema(path)
    names = schema.names
    missing = [column for column in MERGED_COLUMNS if column not in names and column != "history"]
    if missing:
        raise CorpusError(f"{path} lacks the column(s) {missing} of a self-distilled corpus (it has {names}): give a "
                          f"corpus written by `python run.py task=distill_corpus`")
    answer_type = schema.field("answer_ids").type
    if not (pa.types.is_list(answer_type) or pa.types.is_large_list(answer_type)) \
            or not pa.types.is_integer(answer_type.value_type):
        raise CorpusError(f"{path}: answer_ids must be lists of token ids (integers), not {answer_type}")
    table = pq.read_table(path, columns=[c for c in MERGED_COLUMNS if c in names])
    if "history" not in names:
        table = table.append_column("history", pa.array([[]] * table.num_rows, pa.list_(pa.string())))
    return with_history(table)


def read_corpus_metadata(path: Path) -> dict:
    """The metadata `merge_shards` stored in a corpus Parquet file."""
    metadata = _corpus_schema(path).metadata or {}
    if METADATA_KEY not in metadata:
        raise CorpusError(f"{path} is not a specpipe self-distilled corpus (no {METADATA_KEY.decode()} metadata): "
                          f"write one with `python run.py task=distill_corpus`")
    return json.loads(metadata[METADATA_KEY])

