"""Decoding throughput of batched greedy distillation, per dtype, linear path and batch size.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python -m specpipe.distill.throughput [--batch-sizes 8 16 32 64]
        [--variants fp32/onednn fp32/torch bf16/torch bf16/onednn] [--steps 24] [--rounds 3]

Measures the time of one decoding step of HF `generate` for a batch of real prompts (the first
ones of the prompt source, left-padded, every row forced to run all `steps`): a logits processor
stamps the clock at every step, and the shortest gap between stamps is the step time (the least
disturbed step: other processes on this machine stretch most of them, never shorten one). Slot throughput = batch / step time. What a run keeps is less: a finished row idles until its batch ends (the run log
reports kept tokens per second). Rounds interleave the variants, so a load change on this shared
machine hits all of them alike; the best round of each is reported (the least disturbed one), and the prefill seconds of the best round.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specpipe.distill.corpus import BatchedGreedy
from specpipe.distill.prompts import build_prompt_source
from specpipe.pipelines.builder import compose_config, load_model


def load_variant(variant: str, model: str) -> BatchedGreedy:
    """`dtype/linears`, e.g. fp32/onednn: the model in that dtype, linears prepacked for oneDNN or not."""
    dtype, linears = variant.split("/")
    loaded = load_model(compose_config([f"model={model}", f"model.dtype={dtype}"]).model)
    if linears == "onednn":
        from specpipe.engine.onednn import OneDNNEngine

        OneDNNEngine(fuse=True, lean_blocks=False).apply(loaded.model)
    return BatchedGreedy(loaded.model, loaded.tokenizer, max_new_tokens=1)


def batch_inputs(generator: BatchedGreedy, encoded: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), generator.pad_token_id, dtype=torch.long)  # [b, width]
    attention_mask = torch.zeros_like(input_ids)                                            # [b, width]
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class StepClock(LogitsProcessor):
    """Leaves the scores alone; records when each decoding step reaches the logits processors."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def step_seconds(generator: BatchedGreedy, inputs: dict[str, torch.Tensor], steps: int) -> tuple[float, float]:
    """(seconds of the fastest decoding step, seconds of the prefill step)."""
    clock = StepClock()
    started = time.perf_counter()
    with torch.inference_mode():
        generator.model.generate(**inputs, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                                 pad_token_id=generator.pad_token_id, temperature=None, top_p=None, top_k=None,
                                 logits_processor=LogitsProcessorList([clock]))
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return min(gaps), clock.stamps[0] - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--variants", nargs="+", default=["fp32/onednn", "fp32/torch", "bf16/torch", "bf16/onednn"])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generators = {variant: load_variant(variant, args.model) for variant in args.variants}
    prompts = build_prompt_source().prompts[: max(args.batch_sizes)]
    encoded = [next(iter(generators.values())).encode(p) for p in prompts]
    best: dict[tuple[str, int], float] = {}
    prefill_best: dict[tuple[str, int], float] = {}
    for round_index in range(args.rounds):
        for batch_size in args.batch_sizes:
            for variant, generator in generators.items():
                inputs = batch_inputs(generator, encoded[:batch_size])
                step, prefill = step_seconds(generator, inputs, args.steps)
                best[variant, batch_size] = min(best.get((variant, batch_size), float("inf")), step)
                prefill_best[variant, batch_size] = min(prefill_best.get((variant, batch_size), float("inf")), prefill)
                print(f"round {round_index}: {variant:12s} batch {batch_size:3d}: {step * 1e3:7.1f} ms/step, "
                      f"{batch_size / step:6.1f} slot tok/s (prefill {prefill * 1e3:.0f} ms)", flush=True)
    print(f"\nbest of {args.rounds} rounds, {args.steps} decoding steps after the prompt; "
          f"slot tok/s (ms/step; prefill s):")
    print("| variant | " + " | ".join(f"batch {b}" for b in args.batch_sizes) + " |")
    print("|---|" + "---|" * len(args.batch_sizes))
    for variant in generators:
        cells = [f"{b / best[variant, b]:.0f} ({best[variant, b] * 1e3:.0f}; {prefill_best[variant, b]:.1f})"
                 for b in args.batch_sizes]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
