"""Situated chat requests: what a person asks when they bring their own circumstances with them.

The template x subject builders of `specpipe.distill.prompts` ask bare questions ("Write a poem about
autumn."). Real chat requests carry the asker's situation, a purpose, an audience and a constraint, and
the heads trained on the bare ones accept fewer tokens on such questions than on their own corpus's
held-out prompts, while training-free drafting (Jacobi) accepts the same on both. Each request
(data/requests.json) names a situation and an ask of one category; slots ({name}, {city},
{n}, ...) are filled from the seeded generator, and one of the category's constraints (or none) follows
the ask, before any document the request quotes.

An EAGLE-1 head trained with their answers accepts no more on held-out situated requests than one trained
without them: what the heads fit is the template answers' predictability, not their prompts' wording.

Written for this project; nothing here is taken from a benchmark, and `find_overlaps` still drops any
prompt that comes near a dev prompt.
"""
from __future__ import annotations

from collections.abc import Mapping

from specpipe.distill.subjects import load_prompt_data

SITUATED_REQUESTS: Mapping[str, tuple[str, ...]] = load_prompt_data().by_category("situated")
# Added after a request's ask (or nothing, the first entry): the length, format, tone or audience a real
# asker often adds.
CONSTRAINTS: Mapping[str, tuple[str, ...]] = load_prompt_data().by_category("constraints")
