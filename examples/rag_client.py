"""A RAG application talking to specpipe's server with the official `openai` client: the application sends its
own documents with the question (specpipe's `documents` extension) and reads the answer, the chunks it was answered
from and the request's speculation stats.

    .venv/bin/python run.py task=serve pipeline=rag_lookahead            # in one terminal
    .venv/bin/python examples/rag_client.py --base-url http://127.0.0.1:8000/v1 --model smollm2_135m
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from openai import OpenAI

# A small handbook to retrieve from, shared by the examples
HANDBOOK = json.loads((Path(__file__).with_name("handbook.json")).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--api-key", default="none", help="the server's serve.api_key, where it has one")
    parser.add_argument("--question", default="When are expense reports due, and what happens if I submit late?")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    completion = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": args.question}], max_tokens=args.max_tokens,
        extra_body={"documents": HANDBOOK})
    extension = completion.model_extra.get("specpipe", {})
    for chunk in extension.get("retrieved", []):
        print(f"retrieved: {chunk['score']:.3f} {chunk['title']}")
    print(f"answer: {completion.choices[0].message.content}")
    print(f"usage: {completion.usage.completion_tokens} tokens in {extension.get('steps')} steps, "
          f"{extension.get('mean_accepted_tokens')} accepted per step, drafted by "
          f"{extension.get('drafted_tokens_by_source')}")
    print("streamed: ", end="")
    for event in client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": args.question}],
                                                max_tokens=args.max_tokens, stream=True,
                                                extra_body={"documents": HANDBOOK}):
        if event.choices and event.choices[0].delta.content:
            print(event.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
