"""`task=bench`: a Spec-Bench-style benchmark of one pipeline against plain HF decoding and the other methods of
`bench.methods`, in one process (`python run.py task=bench pipeline=lookahead_trie bench.prompts=FILE
bench.per_category=N bench.max_new_tokens=M bench.dtype=fp32|bf16 bench.out=DIR`). It reads the settings
(`specpipe.tasks.bench_settings`), keeps the first N questions of each category of a Spec-Bench question file
(`specpipe.tasks.bench_questions`), builds the methods and `bench.compare`'s pipelines on one target
(`specpipe.tasks.bench_methods`), runs them question by question on the very same prompt ids
(`specpipe.tasks.bench_run`) and writes the report to `bench.out`, by default the Hydra run dir
(`specpipe.tasks.bench_report`): comparing inside one run, question by question, keeps the machine's drift out
of the comparison, where separate jobs would differ by it.
"""
from __future__ import annotations

import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf

import specpipe.distributed as distributed
from specpipe.cost import OtherProcessesLoad
from specpipe.errors import InvalidRequest
from specpipe.models import LoadedModel
from specpipe.pipelines.builder import assemble_pipeline, build_target, load_model, with_pipeline
from specpipe.pipelines.pipeline import Pipeline
from specpipe.tasks.bench_machine import machine_info
from specpipe.tasks.bench_methods import HF_PLD, Method, add_compared, make_methods
from specpipe.tasks.bench_metrics import REFERENCE, run_records, summarize
from specpipe.tasks.bench_questions import read_questions, select_questions
from specpipe.tasks.bench_records import Question
from specpipe.tasks.bench_render import markdown_table
from specpipe.tasks.bench_report import write_report
from specpipe.tasks.bench_run import MethodRuns, run_methods, stop_signals_interrupt
from specpipe.tasks.bench_settings import BenchSettings, hydra_job_info, read_settings


def build_methods(cfg: DictConfig, settings: BenchSettings, loaded: LoadedModel | None,
                  hf_model: torch.nn.Module | None) -> tuple[Pipeline, dict[str, Method]]:
    """The configured pipeline and every method of the run, `bench.compare`'s pipelines last, all on one target.

    The HF methods run `hf_model`, else a separate stock instance of `cfg.model` when the pipeline's engine
    rewrites its own (`engine=fast`), so that `hf_generate` stays transformers' forward."""
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
    add_compared(methods, compared)
    if settings.relative_to is not None and settings.relative_to not in methods:
        raise InvalidRequest(f"bench.relative_to={settings.relative_to!r} is not a method of this run; its methods "
                             f"are {', '.join(methods)}")
    return pipeline, methods


def measure(pipeline: Pipeline, methods: dict[str, Method], questions: list[Question],
            settings: BenchSettings) -> tuple[MethodRuns, dict]:
    """Runs every method over `questions`, under SIGTERM as Ctrl-C and watching the other processes' CPU use;
    returns what was measured and the machine it ran on (summary.json's `machine`)."""
    print(f"bench: {len(questions)} questions x {len(methods)} methods ({', '.join(methods)}) on "
          f"{pipeline.target.name} {settings.dtype}, max_new_tokens={settings.max_new_tokens}, "
          f"warm-up {settings.warmup}", file=sys.stderr)
    load_before = os.getloadavg()[0]
    with OtherProcessesLoad() as others, stop_signals_interrupt():
        measured = run_methods(pipeline, methods, questions, settings.max_new_tokens, settings.warmup,
                               time_limit_s=settings.time_limit_s)
    if measured.stopped:
        print(f"bench: {measured.stopped}; reporting the questions every method finished", file=sys.stderr)
    if others.competed():
        print(f"bench: warning: other processes kept {others.cores:.1f} of the {others.cpus} CPUs busy during "
              f"the runs: the timings are that contention's, not this machine's", file=sys.stderr)
    if not measured.runs:
        raise InvalidRequest("the benchmark produced no results")
    machine = {**machine_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
               "other_processes_cpus": others.cores, "cpus": others.cpus}
    return measured, machine


def run_meta(cfg: DictConfig, settings: BenchSettings, pipeline: Pipeline, methods: dict[str, Method],
             measured: MethodRuns, selected: int, machine: dict) -> dict:
    """summary.json's `meta`: what ran, on which settings, prompts and machine, and how far it got."""
    return {
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
        "questions": len(measured.runs) // len(methods),
        "questions_selected": selected,
        "stopped": measured.stopped,
        "config": OmegaConf.to_container(cfg, resolve=True),
        **hydra_job_info(),
        "machine": machine,
    }


def run_bench(cfg: DictConfig, loaded: LoadedModel | None = None, hf_model: torch.nn.Module | None = None) -> dict:
    """Runs the benchmark described by `cfg.bench` and writes its report; returns summary.json's content.

    `loaded` is an already loaded model to use instead of loading `cfg.model`, and `hf_model` a
    stock instance with the same weights for the HF methods (tests); by default the HF methods
    get a fresh instance of `cfg.model` whenever the engine rewrites the pipeline's.
    """
    settings = read_settings(cfg)
    questions = select_questions(read_questions(settings.prompts), settings.per_category, settings.categories)
    if not questions:
        raise InvalidRequest(f"{settings.prompts} holds no questions; nothing to benchmark")
    pipeline, methods = build_methods(cfg, settings, loaded, hf_model)
    measured, machine = measure(pipeline, methods, questions, settings)
    meta = run_meta(cfg, settings, pipeline, methods, measured, len(questions), machine)
    if not distributed.is_main_process():  # tensor parallel: every rank ran the same decoding; rank 0 reports
        return {**summarize(run_records(measured.runs, settings.group_categories), meta["methods"]), "meta": meta}
    summary = write_report(measured.runs, meta, settings.out)
    print(markdown_table(summary))
    print(f"bench: report written to {settings.out}", file=sys.stderr)
    return summary
