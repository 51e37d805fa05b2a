"""Which rows of a tree verify differ from the one-row forwards of their own paths (issue 84's property).

For each tree shape (five drawn by hand, then random trees of --random sizes), the target verifies the tree once over
a prefilled prompt; then each node's path is decoded again from the same prompt one token per forward (what `vanilla`
does). A node whose logits are not bitwise the path's last one-row logits is listed with its path length and the
largest difference.

    python bench/tree_row_invariance.py --dtype bf16
    python bench/tree_row_invariance.py --dtype bf16 --override engine.kernel_attention=false
    python bench/tree_row_invariance.py --dtype fp32 --override engine.target_weights=dense --random 16 64
"""
from __future__ import annotations

import argparse

import torch

from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.types import DraftTree

SHAPES = {  # parents: -1 = a child of the root
    "chain": list(range(-1, 23)),
    "wide": [-1] * 8,
    "deep": list(range(-1, 11)) + [4, 11, 12],
    "side_branch": list(range(-1, 5)) + [2, 5, 6, 7, 8, 9, 10, 11, 12],
    "two_level": [-1, -1, -1] + [parent for parent in range(3) for _ in range(3)],
}


def random_parents(size: int, generator: torch.Generator) -> list[int]:
    """A random tree of `size` nodes, each node's parent an earlier node or the root (-1), deeper ones likelier."""
    return [int(torch.randint(-1, node, (1,), generator=generator)) if node else -1 for node in range(size)]


def node_paths(parents: list[int]) -> list[list[int]]:
    """Each node's root-to-node path (node ids, the node last)."""
    paths = []
    for node in range(len(parents)):
        path, walk = [], node
        while walk != -1:
            path.append(walk)
            walk = parents[walk]
        paths.append(path[::-1])
    return paths


def differing_rows(target, context: list[int], parents: list[int], tokens: list[int]) -> list[tuple[int, int, float]]:
    """(row, path length, largest |difference|) for each verify row unlike its path's one-row forward (row 0: the
    root, the last prompt token)."""
    cache = target.new_cache()
    target.prefill(context[:-1], cache)
    prefix = cache.get_seq_length()
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    verified = target.forward_tree(context[-1], tree, cache).logits
    differing = []
    for row, path in enumerate([[], *node_paths(parents)]):
        cache.crop(prefix)
        logits = target.forward_tree(context[-1], DraftTree.empty(), cache).logits[0]
        for node in path:
            logits = target.forward_tree(tokens[node], DraftTree.empty(), cache).logits[0]
        if not torch.equal(verified[row], logits):
            differing.append((row, len(path), float((verified[row].float() - logits.float()).abs().max())))
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--override", action="append", default=[], help="a config override (repeatable)")
    parser.add_argument("--random", type=int, nargs="*", default=[], help="sizes of random trees to add")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. The quick brown")
    args = parser.parse_args()
    pipe = build_pipeline(compose_config([f"model={args.model}", f"model.dtype={args.dtype}", "pipeline=vanilla",
                                          "cost_curve=flat", *args.override]))
    context = pipe.tokenizer(args.prompt)["input_ids"]
    generator = torch.Generator().manual_seed(5)
    shapes = dict(SHAPES, **{f"random ({size})": random_parents(size, generator) for size in args.random})
    for name, parents in shapes.items():
        tokens = torch.randint(300, 20000, (len(parents),), generator=torch.Generator().manual_seed(7)).tolist()
        differing = differing_rows(pipe.target, context, parents, tokens)
        print(f"{name}: {len(differing)} of {len(parents) + 1} rows differ"
              + (f" (row, path length, max |diff|): {differing}" if differing else ""), flush=True)


if __name__ == "__main__":
    main()
