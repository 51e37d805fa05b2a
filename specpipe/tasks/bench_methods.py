"""The methods `task=bench` compares, each a callable from a prepared prompt and a token budget to a timed
TurnOutput: transformers' `generate` (`hf_generate`, the reference, and its prompt lookup `hf_pld`), specpipe
pipelines stepped as `Pipeline.generate` steps them (the configured one, `vanilla` without drafting, and
`bench.compare`'s), and a llama.cpp server (`llama_cpp`). They share one signature so that the run loop times
every method the same way, question by question, on the very same prompt ids.
"""
from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from specpipe.errors import InvalidRequest
from specpipe.pipelines.pipeline import GenerationStats, Pipeline, PreparedPrompt
from specpipe.tasks.bench_metrics import REFERENCE, VANILLA
from specpipe.tasks.bench_records import TurnOutput

HF_PLD = "hf_pld"
PIPELINE = "pipeline"  # in bench.methods: the configured pipeline, reported under its own name
# in bench.methods: llama.cpp's server (bench.llama_cpp_url) running the target's GGUF file, greedy on the same ids
LLAMA_CPP = "llama_cpp"
# every name of bench.methods (a pipeline of bench.compare may not take one)
METHOD_NAMES = (REFERENCE, HF_PLD, VANILLA, PIPELINE, LLAMA_CPP)
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

    - `hf_generate`: transformers' greedy `model.generate` (the reference, speedup 1.0),
    - `hf_pld`: transformers' prompt lookup decoding (`prompt_lookup_num_tokens=pld_tokens`),
    - `vanilla`: specpipe's own loop with no drafting, on the same target and engine (the baseline that
      isolates the gain of drafting from the gain of the engine),
    - `pipeline`: the configured specpipe pipeline,
    - `llama_cpp`: llama.cpp's server at `llama_cpp_url`, started beside the run on the target's GGUF file with
      the same threads (the engine CPU users pick, on the file they run).

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


def add_compared(methods: dict[str, Method], compared: Sequence[Pipeline]) -> None:
    """Adds each pipeline of bench.compare to `methods` under its own name, which no method may hold already."""
    for other in compared:
        if other.name in methods or other.name in METHOD_NAMES:
            raise InvalidRequest(f"bench.compare: {other.name!r} is already a method of this run "
                                 f"({', '.join(methods)}); compare other pipelines")
        methods[other.name] = PipelineDecode(other)
