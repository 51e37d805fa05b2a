"""`task=bench`: a Spec-Bench-style benchmark of one pipeline against plain HF decoding.

    python run.py task=bench pipeline=lookahead_trie bench.prompts=FILE bench.per_category=N \
        bench.max_new_tokens=M bench.dtype=fp32|bf16 bench.out=DIR

Reads Spec-Bench question JSONL (`question_id`, `category`, `turns`), keeps the first N
questions of each category and, in one process, runs
every method of `bench.methods` over them:

- `hf_generate`: transformers' greedy `model.generate` (the reference, speedup 1.0),
- `hf_pld`: transformers' prompt lookup decoding (`prompt_lookup_num_tokens=bench.pld_tokens`),
- `vanilla`: specpipe's own loop with no drafting, on the same target and engine (the
  baseline that isolates the gain of drafting from the gain of the engine),
- `pipeline`: the configured specpipe pipeline (reported under its own name),
- `llama_cpp`: llama.cpp's server at `bench.llama_cpp_url`, started beside the run on the target's GGUF file with
  the same threads (the engine CPU users pick, on the file they run),
- and each pipeline of `bench.compare` (conf/pipeline/ names, e.g. `[prompt_lookup,lookahead_trie]`),
  built on the same target and run on the same prompts, reported under its own name: a comparison of
  pipelines inside one run, question by question, where separate jobs would differ by the machine's drift.

The HF methods run on a separate stock instance of the model when the pipeline's engine
rewrites its own (`engine=fast`), so `hf_generate` stays transformers' forward.

Every method sees the same prompt token ids: `Pipeline.prepare` of the chat messages, which for a
RAG pipeline (`pipeline.augmenter` set) retrieves chunks for the current turn's question and
renders them into its message, so `hf_generate`, `hf_pld` and `vanilla` answer the very prompt the
pipeline answers. Retrieval runs before the methods' clocks start. In multi-turn questions each
method carries its own previous answer into the next turn.
`bench.group_categories` reports several prompt categories as one (Spec-Bench's eight MT-bench
categories as `mt_bench`); `bench.per_category` still counts questions per original category.
`bench.dtype` sets the model's dtype: `conf/task/bench.yaml` interpolates
`model.dtype: ${bench.dtype}`. Results go to `bench.out` (default: the Hydra run dir);
see `specpipe.tasks.bench_report` for the files written.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

import specpipe.distributed as distributed
from specpipe.cost import OtherProcessesLoad
from specpipe.errors import ConfigError, InvalidRequest
from specpipe.models import LoadedModel, parse_dtype
from specpipe.paths import CHECKOUT_ROOT
from specpipe.pipelines.builder import assemble_pipeline, build_target, load_model, with_pipeline
from specpipe.pipelines.pipeline import GenerationStats, Pipeline, PreparedPrompt
from specpipe.tasks.bench_records import Question, QuestionRun, TurnOutput

REFERENCE = "hf_generate"
HF_PLD = "hf_pld"
PIPELINE = "pipeline"  # in bench.methods: the configured pipeline, reported under its own name
VANILLA = "vanilla"  # in bench.methods: specpipe's loop without drafting (same target and engine)
# in bench.methods: llama.cpp's server (bench.llama_cpp_url) running the target's GGUF file, greedy on the same ids
LLAMA_CPP = "llama_cpp"
# Spec-Bench's evaluation reports its eight MT-bench categories as one task.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEFAULT_GROUPS = {category: "mt_bench" for category in MT_BENCH_CATEGORIES}


# ---- questions -----------------------------------------------------------------------
def read_questions(path: Path) -> list[Question]:
    """Parses Spec-Bench question JSONL; a malformed line stops with its line number."""
    questions: list[Question] = []
    seen: dict[int | str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidRequest(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            questions.append(_parse_question(row, where))
            qid = questions[-1].question_id
            if qid in seen:
                raise InvalidRequest(f"{where}: question_id {qid!r} already used on line {seen[qid]}")
            seen[qid] = number
    return questions


def _parse_question(row: object, where: str) -> Question:
    if not isinstance(row, dict):
        raise InvalidRequest(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in row]
    if missing:
        raise InvalidRequest(f"{where}: missing {', '.join(missing)} (Spec-Bench format: "
                             f'{{"question_id": 1, "category": "qa", "turns": ["..."]}})')
    qid, category, turns = row["question_id"], row["category"], row["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise InvalidRequest(f"{where}: question_id must be an integer or a string, got {qid!r}")
    if not isinstance(category, str) or not category:
        raise InvalidRequest(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidRequest(f"{where}: turns must be a non-empty list of non-empty strings")
    return Question(qid, category, tuple(turns))


def select_questions(questions: Sequence[Question], per_category: int,
                     categories: Sequence[str] | None = None) -> list[Question]:
    """The first `per_category` questions of each category (file order), optionally only `categories`,
    taken in turns: every category's first question, then every category's second, ... A run cut short
    by `bench.time_limit_s` (a lent GPU's minutes) has then measured every category about equally."""
    if not isinstance(per_category, int) or isinstance(per_category, bool) or per_category <= 0:
        raise InvalidRequest(f"bench.per_category must be a positive integer, got {per_category!r}")
    available = list(dict.fromkeys(q.category for q in questions))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise InvalidRequest(f"bench.categories: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                                 f"{', '.join(map(repr, unknown))}; the prompts file has {', '.join(available)}")
        available = [c for c in available if c in categories]
    by_category: dict[str, list[Question]] = {category: [] for category in available}
    for question in questions:
        chosen = by_category.get(question.category)
        if chosen is not None and len(chosen) < per_category:
            chosen.append(question)
    return [chosen[rank] for rank in range(per_category) for chosen in by_category.values() if rank < len(chosen)]


def resolve_prompts_path(name: str) -> Path:
    """A relative path is looked up from the working directory, then from the checkout (bench/ is not installed)."""
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, CHECKOUT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise InvalidRequest(f"bench.prompts={name}: no such file (looked at {', '.join(map(str, candidates))}); "
                         f"give a Spec-Bench question JSONL, e.g. bench.prompts=bench/dev_prompts.jsonl")


# ---- methods -------------------------------------------------------------------------
Method = Callable[[PreparedPrompt, int], TurnOutput]  # (prepared prompt, max new tokens) -> output


class _StepRecorder(BaseStreamer):
    """Records how many tokens `generate` commits per step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.lengths.append(int(value.numel()))
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFGenerate:
    """transformers' own `generate` on the pipeline's model object: greedy, or sampling with
    the pipeline's temperature / top-k / top-p when `sampling.temperature > 0`.

    `prompt_lookup_num_tokens` switches on HF's prompt lookup decoding. Target forwards are
    counted with a forward pre-hook on the model during the call (the prefill counts as one,
    as in `GenerationStats`); per-step accepted lengths come from a streamer.
    """

    def __init__(self, pipeline: Pipeline, model: torch.nn.Module, prompt_lookup_num_tokens: int | None = None) -> None:
        self.model = model
        self.eos_token_ids = sorted(pipeline.eos_token_ids)
        pad = pipeline.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else None)
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.sampling = pipeline.sampling

    def __call__(self, prompt: PreparedPrompt, max_new_tokens: int) -> TurnOutput:
        prompt_ids = prompt.token_ids
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, L]
        options = {"prompt_lookup_num_tokens": self.prompt_lookup_num_tokens} if self.prompt_lookup_num_tokens else {}
        if self.sampling.greedy:
            options["do_sample"] = False
        else:  # the same warpers, in the same order, as the pipeline's sampling (specpipe.sampling)
            options.update(do_sample=True, temperature=self.sampling.temperature, top_k=self.sampling.top_k,
                           top_p=self.sampling.top_p)
            if self.sampling.seed is not None:
                torch.manual_seed(self.sampling.seed)
        forwards = [0]

        def count_forward(module, args, kwargs) -> None:
            forwards[0] += 1

        recorder = _StepRecorder()
        hook = self.model.register_forward_pre_hook(count_forward, with_kwargs=True)
        try:
            started = time.perf_counter()
            output = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                streamer=recorder, **options)
            seconds = time.perf_counter() - started
        finally:
            hook.remove()
        tokens = output[0, len(prompt_ids):].tolist()
        return TurnOutput(tokens, seconds, forwards[0], recorder.lengths)


class PipelineDecode:
    """The configured specpipe pipeline, stepped exactly as `Pipeline.generate` does."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def __call__(self, prompt: PreparedPrompt, max_new_tokens: int) -> TurnOutput:
        stats = GenerationStats()
        tokens: list[int] = []
        drafted = 0
        started = time.perf_counter()
        # The PreparedPrompt itself, not its ids: the retrieved documents' ids go to the decoder too.
        for step in self.pipeline.steps(prompt, max_new_tokens):
            tokens.extend(step.tokens)
            drafted += step.drafted
            stats.add(step)
        seconds = time.perf_counter() - started
        # Every proposer is listed, at 0 when none of its drafts was accepted.
        by_source = {proposer.name: 0 for proposer in self.pipeline.decoder.proposers} | stats.drafted_by_source
        return TurnOutput(tokens, seconds, stats.steps, stats.accept_lengths, drafted, by_source)


class LlamaCppServer:
    """llama.cpp's own server (`llama-server -m MODEL.gguf -t THREADS`, started beside the benchmark on the target's
    GGUF file): greedy completion of the very prompt ids through its /completion endpoint, timed from the request
    to the answer (prefill included) as the other methods are. It decodes one token a forward."""

    def __init__(self, url: str | None, timeout_s: float = 600.0) -> None:
        if not url:
            raise InvalidRequest(f"bench.methods has {LLAMA_CPP}: give bench.llama_cpp_url=http://HOST:PORT, a running "
                                 f"llama-server on the target's GGUF file with the benchmark's threads (llama-server "
                                 f"-m MODEL.gguf -t THREADS --port PORT)")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
                response.read()
        except (OSError, ValueError) as error:
            raise InvalidRequest(f"bench.llama_cpp_url={url}: no llama-server answers there ({error})") from None

    def __call__(self, prompt: PreparedPrompt, max_new_tokens: int) -> TurnOutput:
        body = json.dumps({"prompt": list(prompt.token_ids), "n_predict": max_new_tokens, "temperature": 0.0,
                           "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        request = urllib.request.Request(f"{self.url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            answer = json.loads(response.read())
        seconds = time.perf_counter() - started
        tokens = [int(token) for token in answer.get("tokens") or []]
        return TurnOutput(tokens, seconds, len(tokens) + 1, [1] * len(tokens))


def make_methods(names: Sequence[str], pipeline: Pipeline, pld_tokens: int,
                 hf_model: torch.nn.Module | None = None, llama_cpp_url: str | None = None) -> dict[str, Method]:
    """Method name -> callable, in the order given; `pipeline` is reported under the pipeline's name.

    The HF methods run `hf_model` (default: the pipeline's own model, when its engine left it stock).
    """
    if not names:
        raise InvalidRequest(f"bench.methods is empty; choose some of {REFERENCE}, {HF_PLD}, {VANILLA}, {PIPELINE}")
    hf_model = hf_model if hf_model is not None else pipeline.target.model
    methods: dict[str, Method] = {}
    for name in names:
        if name == REFERENCE:
            methods[REFERENCE] = HFGenerate(pipeline, hf_model)
        elif name == HF_PLD:
            methods[HF_PLD] = HFGenerate(pipeline, hf_model, prompt_lookup_num_tokens=pld_tokens)
        elif name in (PIPELINE, pipeline.name):
            methods[pipeline.name] = PipelineDecode(pipeline)
        elif name == VANILLA:  # the same as the pipeline when that is vanilla: run once
            methods[VANILLA] = PipelineDecode(pipeline.without_drafting(VANILLA))
        elif name == LLAMA_CPP:
            methods[LLAMA_CPP] = LlamaCppServer(llama_cpp_url)
        else:
            raise InvalidRequest(f"bench.methods: unknown method {name!r}; choose among {REFERENCE}, {HF_PLD}, "
                                 f"{VANILLA} (specpipe's loop without drafting), {PIPELINE} (the configured "
                                 f"pipeline, here {pipeline.name!r}), {LLAMA_CPP} (a llama-server at "
                                 f"bench.llama_cpp_url)")
    return methods


# ---- running -------------------------------------------------------------------------
def prepare_prompt(pipeline: Pipeline, messages: list[dict], prepared: dict[str, PreparedPrompt]) -> PreparedPrompt:
    """`pipeline.prepare(messages)`, once per distinct conversation of a question: the methods' first
    turns, and later turns where their earlier answers agree, get the very same ids and retrieval."""
    key = json.dumps(messages, sort_keys=True)
    if key not in prepared:
        prepared[key] = pipeline.prepare(messages)
    return prepared[key]


def run_question(pipeline: Pipeline, method_name: str, method: Method, question: Question,
                 max_new_tokens: int, prepared: dict[str, PreparedPrompt] | None = None) -> QuestionRun:
    """All turns of one question; the method's own answer goes into the next turn's messages.
    `prepared` memoizes the prompts across the methods run on this question."""
    prepared = {} if prepared is None else prepared
    run = QuestionRun(question, method_name)
    messages: list[dict] = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        prompt = prepare_prompt(pipeline, messages, prepared)
        output = method(prompt, max_new_tokens)
        text = pipeline.decode_text(output.tokens)
        run.turns.append(output)
        run.texts.append(text)
        run.prompts.append(prompt)
        messages.append({"role": "assistant", "content": text})
    return run


@contextmanager
def learning_paused(*pipelines: Pipeline) -> Iterator[None]:
    """Stages that learn from finished answers (the store of past outputs) learn nothing during the
    warm-up: the counted run of the same question would otherwise draft from its own earlier answer."""
    learners = [p for pipeline in pipelines for p in pipeline.decoder.proposers if getattr(p, "learn", False) is True]
    for proposer in learners:
        proposer.learn = False
    try:
        yield
    finally:
        for proposer in learners:
            proposer.learn = True


@dataclass
class MethodRuns:
    """What `run_methods` measured: every method's run of each question it finished, in order, and why
    it stopped before the last question (None when it ran them all)."""

    runs: list[QuestionRun]
    stopped: str | None = None


def run_methods(pipeline: Pipeline, methods: dict[str, Method], questions: Sequence[Question],
                max_new_tokens: int, warmup: int = 1, progress: bool = True,
                time_limit_s: float | None = None) -> MethodRuns:
    """Warms every method up on the first `warmup` questions (not counted), then runs each question
    through every method in turn (interleaved, so slow drift of the machine hits all methods alike).

    It stops early, keeping only questions that every method finished (so each comparison stays
    question by question), when the next question would end past `time_limit_s` (seconds from the
    start of the warm-up; judged by the mean time of the questions so far), or on KeyboardInterrupt
    (Ctrl-C, or SIGTERM under `stop_signals_interrupt`) once at least one question is done."""
    started = time.monotonic()
    # the pipelines that decode here: the configured one and bench.compare's (each once)
    decoding = [method.pipeline for method in methods.values() if isinstance(method, PipelineDecode)]
    with learning_paused(*decoding):
        for question in questions[:warmup]:
            prepared: dict[str, PreparedPrompt] = {}
            for name, method in methods.items():
                run_question(pipeline, name, method, question, max_new_tokens, prepared)
    measured = MethodRuns([])
    counted = time.monotonic()
    with tqdm(total=len(questions) * len(methods), desc="bench", unit="run", disable=not progress,
              file=sys.stderr) as bar:
        for done, question in enumerate(questions):
            if time_limit_s is not None and done > 0:
                now = time.monotonic()
                if now - started + (now - counted) / done > time_limit_s:  # + the mean question's time
                    measured.stopped = (f"bench.time_limit_s={time_limit_s:g}: stopped after {done} of "
                                        f"{len(questions)} questions")
                    break
            prepared = {}
            finished = []
            try:
                for name, method in methods.items():
                    bar.set_postfix_str(f"{question.category} #{question.question_id} {name}", refresh=False)
                    finished.append(run_question(pipeline, name, method, question, max_new_tokens, prepared))
                    bar.update()
            except KeyboardInterrupt:
                if done == 0:
                    raise
                measured.stopped = f"interrupted: stopped after {done} of {len(questions)} questions"
                break
            measured.runs.extend(finished)
    return measured


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM (a job scheduler's or `timeout`'s end of the time) raises KeyboardInterrupt while the
    benchmark runs, as Ctrl-C does, so the questions already finished are still reported."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class BenchSettings:
    prompts: Path
    per_category: int
    max_new_tokens: int
    dtype: str
    methods: tuple[str, ...]
    compare: tuple[str, ...]  # further pipelines (conf/pipeline/ names) run as methods of their own
    warmup: int
    pld_tokens: int
    categories: tuple[str, ...] | None
    group_categories: dict[str, str]  # category -> the category it is reported under
    out: Path
    time_limit_s: float | None = None  # stop before a question that would end past it (warm-up included)
    relative_to: str | None = None  # a method the report gives every other's speed over, with an interval
    llama_cpp_url: str | None = None  # the llama-server of method llama_cpp


def read_settings(cfg: DictConfig) -> BenchSettings:
    bench = cfg.get("bench")
    if bench is None:
        raise ConfigError("task=bench needs the `bench` settings of conf/task/bench.yaml; run with task=bench")
    if parse_dtype(cfg.model.dtype) != parse_dtype(bench.dtype):
        raise ConfigError(f"the benchmark sets the model dtype from bench.dtype ({bench.dtype}), but model.dtype "
                          f"was set to {cfg.model.dtype}; use bench.dtype={cfg.model.dtype} instead")
    max_new_tokens = bench.max_new_tokens
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise InvalidRequest(f"bench.max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    warmup = int(bench.get("warmup") or 0)
    if warmup < 0:
        raise InvalidRequest(f"bench.warmup must be >= 0, got {warmup}")
    categories = bench.get("categories")
    if isinstance(categories, str):
        categories = [categories]
    time_limit_s = bench.get("time_limit_s")
    if time_limit_s is not None:
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
            raise InvalidRequest(f"bench.time_limit_s must be a positive number of seconds or null, got "
                                 f"{time_limit_s!r}")
        if distributed.active():  # each rank would judge the time by its own clock and stop at another question
            raise ConfigError("bench.time_limit_s is not supported with tensor parallel ranks: leave it null")
    return BenchSettings(
        prompts=resolve_prompts_path(str(bench.prompts)),
        group_categories=read_groups(bench.get("group_categories", DEFAULT_GROUPS)),
        per_category=bench.per_category,
        max_new_tokens=max_new_tokens,
        dtype=str(bench.dtype),
        methods=tuple(bench.get("methods") or ()),
        compare=read_compare(bench.get("compare")),
        warmup=warmup,
        pld_tokens=int(bench.get("pld_tokens") or 10),
        categories=tuple(categories) if categories else None,
        out=output_dir(bench.get("out")),
        time_limit_s=float(time_limit_s) if time_limit_s is not None else None,
        relative_to=read_relative_to(bench.get("relative_to")),
        llama_cpp_url=bench.get("llama_cpp_url"),
    )


def read_relative_to(name: object) -> str | None:
    """bench.relative_to: one method name, or null."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"bench.relative_to must name one method of this run (e.g. vanilla, or a pipeline of "
                             f"bench.compare), or be null; got {name!r}")
    return name


def read_compare(compare: object) -> tuple[str, ...]:
    """bench.compare: a list of conf/pipeline/ names (one name alone is taken as a list of one)."""
    if compare is None:
        return ()
    if isinstance(compare, str):
        compare = [compare]
    names = list(compare) if not isinstance(compare, (Mapping, DictConfig)) else None
    if names is None or not all(isinstance(name, str) and name for name in names):
        raise InvalidRequest(f"bench.compare must list pipelines of conf/pipeline/, e.g. [prompt_lookup,lookahead_trie]; "
                             f"got {compare!r}")
    return tuple(names)


def read_groups(groups: object) -> dict[str, str]:
    """bench.group_categories: {category: reported category}; null reports every category alone."""
    if groups is None:
        return {}
    if isinstance(groups, DictConfig):
        groups = OmegaConf.to_container(groups, resolve=True)
    if not isinstance(groups, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                  for k, v in groups.items()):
        raise InvalidRequest(f"bench.group_categories must map categories to the category they are reported "
                             f"under, e.g. {{writing: mt_bench}}; got {groups!r}")
    return dict(groups)


def output_dir(out: str | None, key: str = "bench.out") -> Path:
    """`out` (the config's `key`), or the Hydra run dir; in a multirun every job writes into its own job dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN and out:
        raise ConfigError("in a multirun (-m) every job writes into its own Hydra job dir and the sweep merges "
                          f"them: leave {key} unset and choose the place with hydra.sweep.dir=DIR")
    if out:
        return Path(str(out)).expanduser()
    if hydra_cfg is None:
        raise ConfigError(f"{key} is not set and there is no Hydra run dir to default to; give {key}=DIR")
    return Path(hydra_cfg.runtime.output_dir)


def hydra_job_info() -> dict:
    """The command line and overrides of the current Hydra job (empty outside `run.py`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"command": " ".join(sys.argv), "overrides": [], "job_num": None}
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    job_num = hydra_cfg.job.get("num") if hydra_cfg.mode.name == "MULTIRUN" else None
    return {"command": "python run.py " + " ".join(overrides), "overrides": overrides, "job_num": job_num}


def run_bench(cfg: DictConfig, loaded: LoadedModel | None = None, hf_model: torch.nn.Module | None = None) -> dict:
    """Runs the benchmark described by `cfg.bench` and writes its report; returns summary.json's content.

    `loaded` is an already loaded model to use instead of loading `cfg.model`, and `hf_model` a
    stock instance with the same weights for the HF methods (tests); by default the HF methods
    get a fresh instance of `cfg.model` whenever the engine rewrites the pipeline's.
    """
    from specpipe.tasks import bench_report

    settings = read_settings(cfg)
    questions = select_questions(read_questions(settings.prompts), settings.per_category, settings.categories)
    if not questions:
        raise InvalidRequest(f"{settings.prompts} holds no questions; nothing to benchmark")
    given_model = loaded is not None
    loaded = loaded or load_model(cfg.model)
    target, engine = build_target(cfg, loaded)
    pipeline = assemble_pipeline(cfg, target, loaded, engine)
    compared = [assemble_pipeline(with_pipeline(cfg, name), target, loaded, engine) for name in settings.compare]
    if hf_model is None and pipeline.target.engine != "hf" and {REFERENCE, HF_PLD} & set(settings.methods):
        if given_model:
            raise ValueError("run_bench(loaded=...) with an engine that rewrites the model needs hf_model=, a "
                             "stock instance with the same weights for the HF methods")
        hf_model = load_model(cfg.model).model  # stock weights and forward for the HF methods
    methods = make_methods(settings.methods, pipeline, settings.pld_tokens, hf_model, settings.llama_cpp_url)
    for other in compared:
        if other.name in methods or other.name in (REFERENCE, HF_PLD, VANILLA, PIPELINE, LLAMA_CPP):
            raise InvalidRequest(f"bench.compare: {other.name!r} is already a method of this run "
                                 f"({', '.join(methods)}); compare other pipelines")
        methods[other.name] = PipelineDecode(other)
    if settings.relative_to is not None and settings.relative_to not in methods:
        raise InvalidRequest(f"bench.relative_to={settings.relative_to!r} is not a method of this run; its methods "
                             f"are {', '.join(methods)}")
    print(f"bench: {len(questions)} questions x {len(methods)} methods ({', '.join(methods)}) on "
          f"{pipeline.target.name} {settings.dtype}, max_new_tokens={settings.max_new_tokens}, "
          f"warm-up {settings.warmup}", file=sys.stderr)
    load_before = os.getloadavg()[0]
    with OtherProcessesLoad() as others, stop_signals_interrupt():
        measured = run_methods(pipeline, methods, questions, settings.max_new_tokens, settings.warmup,
                               time_limit_s=settings.time_limit_s)
    runs = measured.runs
    if measured.stopped:
        print(f"bench: {measured.stopped}; reporting the questions every method finished", file=sys.stderr)
    if others.competed():
        print(f"bench: warning: other processes kept {others.cores:.1f} of the {others.cpus} CPUs busy during "
              f"the runs: the timings are that contention's, not this machine's", file=sys.stderr)
    if not runs:
        raise InvalidRequest("the benchmark produced no results")
    meta = {
        "pipeline": pipeline.name,
        "engine": pipeline.target.engine,
        "model": pipeline.target.name,
        "dtype": settings.dtype,
        "torch_dtype": str(pipeline.target.dtype),
        "methods": list(methods),
        "reference": REFERENCE if REFERENCE in methods else None,
        "prompts": str(settings.prompts),
        "per_category": settings.per_category,
        "group_categories": settings.group_categories,
        # RAG: every method ran on the augmented prompt (chunks per question in results.parquet)
        "augmented": pipeline.augmenter is not None,
        "max_new_tokens": settings.max_new_tokens,
        "warmup": settings.warmup,
        "pld_tokens": settings.pld_tokens,
        "relative_to": settings.relative_to,
        "sampling": OmegaConf.to_container(cfg.sampling, resolve=True),
        "questions": len(runs) // len(methods),
        "questions_selected": len(questions),
        "stopped": measured.stopped,
        "config": OmegaConf.to_container(cfg, resolve=True),
        **hydra_job_info(),
        "machine": {**bench_report.machine_info(), "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg()[0], "other_processes_cpus": others.cores,
                    "cpus": others.cpus},
    }
    if not distributed.is_main_process():  # tensor parallel: every rank ran the same decoding; rank 0 reports
        return {**bench_report.summarize(bench_report.run_records(runs, settings.group_categories), meta["methods"]),
                "meta": meta}
    summary = bench_report.write_report(runs, meta, settings.out)
    print(bench_report.markdown_table(summary))
    print(f"bench: report written to {settings.out}", file=sys.stderr)
    return summary
