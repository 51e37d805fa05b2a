"""A small RAG application on specpipe's Python API: the application brings its own documents,
asks a question, and prints the chunks it was answered from, the answer and the decoding stats.

    python examples/rag_app.py [--max-new-tokens N] [--store DIR]

(with specpipe installed: `make install` in a checkout, or `pip install` of the package or its wheel).

Without --store the handbook in examples/handbook.json is embedded in memory; with it, a store built by
`specpipe task=build_store store=documents store.sources=[...] store.out=DIR` is searched.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpipe import Pipeline

# A small handbook to retrieve from, shared by the examples
HANDBOOK = json.loads((Path(__file__).with_name("handbook.json")).read_text())


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
