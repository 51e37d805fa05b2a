"""A small RAG application on specpipe's Python API: the application brings its own documents,
asks a question, and prints the chunks it was answered from, the answer and the decoding stats.

    .venv/bin/python examples/rag_app.py [--max-new-tokens N] [--store DIR]

Without --store the documents below are embedded in memory; with it, a store built by
`python run.py task=build_store store=documents store.sources=[...] store.out=DIR` is searched.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specpipe import Pipeline  # noqa: E402

HANDBOOK = [
    "Expense reports are due on the fifth working day of the following month. Reports submitted later "
    "are paid with the next payroll run.",
    "Travel must be booked through the travel desk at least ten days before departure. Economy class is "
    "the default for flights under six hours.",
    "Remote work is possible up to three days a week after the probation period, with the agreement of "
    "the team lead.",
    "Laptops are replaced every four years. A broken laptop is repaired or replaced by the IT service desk "
    "within two working days.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="When are expense reports due, and what happens if I submit late?")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--store", help="a document store folder to search instead of the built-in handbook")
    args = parser.parse_args()

    pipe = Pipeline.from_config(["pipeline=rag_lookahead"])
    documents = None
    if args.store:
        from specpipe.stores.document_store import DocumentStore

        documents = DocumentStore.load(args.store)
    else:
        documents = HANDBOOK
    for chunk in pipe.retrieve(args.question, documents):
        print(f"retrieved: {chunk.score:.3f} {chunk.title}: {chunk.text[:70]}...")
    out = pipe.generate(args.question, max_new_tokens=args.max_new_tokens, documents=documents)
    print(f"answer: {out.text}")
    print(f"stats: {out.stats.summary()}")


if __name__ == "__main__":
    main()
