"""How far a target quantized at load (engine.target_weights=int8|int4) is from the weights it was given: top-1
agreement with them and perplexity, teacher-forced over the shipped self-distillation corpus (the model's own greedy
answers to chat prompts, chat template applied).

    python bench/quantized_agreement.py [--samples 64] [--model smollm2_135m] [--json out.json]

Speculation is lossless relative to the quantized target (its greedy output is the quantized model's own); this
measures what the quantization itself changes.
"""
from __future__ import annotations

import argparse
import json
import math

import pandas as pd
import torch
from tqdm import tqdm

from specpipe.engine.gguf_weights import QUANTIZE_AT_LOAD, quantize_linears
from specpipe.paths import DATA_DIR
from specpipe.pipelines.builder import compose_config, load_model


def sequences(tokenizer, samples: int) -> list[tuple[list[int], int]]:
    """(token ids, where the answer starts) of the first `samples` first-turn answers of the chat corpus."""
    corpus = pd.read_parquet(DATA_DIR / "self_distill" / "smollm2_135m_chat.parquet")
    corpus = corpus[corpus["history"].map(len) == 0] if "history" in corpus else corpus
    out = []
    for row in corpus.head(samples).itertuples():
        text = tokenizer.apply_chat_template([{"role": "user", "content": row.prompt}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append((prompt + [int(token) for token in row.answer_ids], len(prompt)))
    return out


@torch.inference_mode()
def answer_logits(model, batch: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per sequence: [answer length, vocab] fp32 logits predicting each answer token."""
    out = []
    for ids, start in batch:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        out.append(logits[start - 1:len(ids) - 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_cfg = compose_config([f"model={args.model}"]).model
    loaded = load_model(model_cfg)
    data = sequences(loaded.tokenizer, args.samples)
    targets = [torch.tensor(ids[start:]) for ids, start in data]
    reference = answer_logits(loaded.model, tqdm(data, desc="as loaded"))
    rows = []
    for kind in ("as loaded", *QUANTIZE_AT_LOAD):
        if kind == "as loaded":
            logits = reference
        else:
            model = load_model(model_cfg).model
            quantize_linears(model, kind)
            logits = answer_logits(model, tqdm(data, desc=kind))
        agree = sum(int((ours.argmax(-1) == theirs.argmax(-1)).sum()) for ours, theirs in zip(logits, reference))
        nll = sum(float(torch.nn.functional.cross_entropy(ours, target, reduction="sum"))
                  for ours, target in zip(logits, targets))
        tokens = sum(len(target) for target in targets)
        rows.append({"weights": kind, "format": QUANTIZE_AT_LOAD.get(kind, "as loaded"), "tokens": tokens,
                     "top1_agreement": agree / tokens, "perplexity": math.exp(nll / tokens)})
    print(f"| weights | blocks | answer tokens | top-1 agreement with as loaded | perplexity |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['weights']} | {row['format']} | {row['tokens']} | {row['top1_agreement']:.4f} | "
              f"{row['perplexity']:.3f} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"model": args.model, "samples": args.samples, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
