"""Run by tests/test_placement.py under `torchrun --nproc-per-node 2`: decodes the given prompts
with a tensor-parallel target on every rank and writes what rank 0 saw, and whether every rank
saw the same, to the JSON file named on the command line.

    torchrun --nproc-per-node 2 tests/tensor_parallel_worker.py MODEL_DIR REQUEST.json OUT.json

REQUEST.json: {"prompts": [[ids...]...], "max_new_tokens": N, "pipelines": {NAME: [overrides...]}}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specpipe.pipelines.builder import build_pipeline, compose_config  # noqa: E402



def main(model_dir: str, request_file: str, out_file: str) -> None:
    request = json.loads(Path(request_file).read_text())
    prompts, max_new_tokens = request["prompts"], request["max_new_tokens"]
    results: dict = {}
    for name, overrides in request["pipelines"].items():
        cfg = compose_config(["model=local", f"model.path={model_dir}", "model.tp_plan=auto", f"pipeline={name}",
                              "cost_curve=measured", *overrides])
        pipe = build_pipeline(cfg)
        results[name] = [pipe.generate(prompt, max_new_tokens=max_new_tokens).token_ids for prompt in prompts]
    # sampling without a seed: the ranks must still agree (rank 0 draws the seed)
    cfg = compose_config(["model=local", f"model.path={model_dir}", "model.tp_plan=auto", "pipeline=lookahead_trie",
                          "cost_curve=flat", "verifier=rejection", "sampling.temperature=1.0"])
    sampled = build_pipeline(cfg)
    results["sampled"] = [sampled.generate(prompt, max_new_tokens=max_new_tokens).token_ids for prompt in prompts]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        report = {"world_size": dist.get_world_size(), "ranks_agree": all(r == results for r in gathered),
                  "tokens": results, "sharded": type(pipe.target.model.model.layers[0].mlp.down_proj.weight).__name__}
        Path(out_file).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
