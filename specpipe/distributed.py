"""What differs when `torchrun` starts one process per shard of a tensor-parallel target.

Every rank runs the whole decode loop on the same inputs, and each target forward is a
collective: the ranks must take identical decisions or they wait on each other forever.
Decisions that depend on this process alone (a measured cost curve, a fresh random seed) are
therefore made on rank 0 and broadcast; output and files are written by rank 0 only.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def active() -> bool:
    """True inside a process group of more than one process (torchrun with N > 1)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def launched_processes() -> int:
    """How many processes `torchrun` started for this run (1 when it did not start this one), known
    before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if active():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))  # before transformers initializes the group


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main_process() -> bool:
    return rank() == 0


def broadcast_from_main(value: T) -> T:
    """Rank 0's `value` on every rank (any picklable object); the value itself outside a group."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. builds a store on first use), the others after it has
    finished, so they find the result instead of racing to build it too."""
    if not active():
        yield
        return
    if not is_main_process():
        dist.barrier()
    try:
        yield
    finally:
        if is_main_process():
            dist.barrier()


@contextlib.contextmanager
def output_on_main_only() -> Iterator[None]:
    """Under torchrun only rank 0 prints (the other ranks decode the same text); the process group
    transformers opened for tensor parallel is closed when the task ends."""
    try:
        if rank() == 0:
            yield
        else:
            logging.disable(logging.WARNING)  # errors still show: a failing rank must say why
            os.environ["TQDM_DISABLE"] = "1"  # rank 0's progress bars are the run's
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
