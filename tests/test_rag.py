"""RAG and drafting beyond the context: the store of past outputs, retrieved-chunk drafting, the
`rag_lookahead` pipeline and its application API, and requests served from several threads.

Lossless oracle: every greedy pipeline's tokens equal plain greedy decoding (HF `generate` on a
separate reference instance) of the same prompt token ids, the augmented prompt for RAG.
"""
from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from conftest import REPO, random_prompts, run_steps
from specpipe.errors import InvalidRequest, StoreError
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.retrieve.past_outputs import PastOutputsRetriever
from specpipe.stages.retrieve.prompt_ngram import PromptNgram
from specpipe.stores.document_store import DocumentStore
from specpipe.stores.past_outputs import PastOutputs
from specpipe.types import DecodeState

DOCUMENTS = [
    "The with statement wraps the execution of a block with methods defined by a context manager. "
    "The context manager's __enter__() method is invoked before the block and its __exit__() method after it, "
    "even when the block raises an exception.",
    "A list is a mutable sequence; a tuple is an immutable sequence. Lists are written with square brackets "
    "and tuples with parentheses.",
    "The yield statement turns a function into a generator function: calling it returns a generator "
    "iterator whose __next__() method runs the body until the next yield.",
    "Dictionaries map hashable keys to values. The get() method returns a default instead of raising "
    "KeyError when the key is missing.",
]


# ---- the store of past outputs ------------------------------------------------------------------
def brute_force_continuations(answers: list[list[int]], context: list[int], min_n: int, max_n: int,
                              max_matches: int, max_length: int) -> list[tuple[int, list[int]]]:
    found, used = [], set()
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        suffix = context[-n:]
        for answer_id in reversed(range(len(answers))):
            answer = answers[answer_id]
            for end in reversed(range(n, len(answer) + 1)):
                if answer[end - n:end] == suffix and end < len(answer) and (answer_id, end) not in used:
                    used.add((answer_id, end))
                    found.append((n, answer[end:end + max_length]))
                    if len(found) == max_matches:
                        return found
    return found


@pytest.mark.parametrize("seed", range(4))
def test_past_outputs_find_what_brute_force_finds(seed):
    rng = random.Random(seed)
    store = PastOutputs(max_tokens=10_000, min_ngram=2, max_ngram=4)
    answers = [[rng.randrange(6) for _ in range(rng.randrange(2, 40))] for _ in range(30)]
    for answer in answers:
        store.insert(answer)
    for _ in range(50):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        expected = brute_force_continuations(answers, context, 2, 4, 8, 5)
        assert store.continuations(context, 8, 5) == expected


def test_past_outputs_stay_within_their_token_bound_dropping_the_oldest():
    store = PastOutputs(max_tokens=100, min_ngram=2, max_ngram=3)
    for i in range(30):
        store.insert([1000 + i, 1, 2, 3, 2000 + i] * 2)  # 10 tokens each
    assert store.token_count <= 100 and len(store) == 10
    continuations = store.continuations([1, 2], max_matches=100, max_length=3)
    assert continuations and all(c[0] == 3 for _, c in continuations)
    assert {c[1] for _, c in continuations} == {2000 + i for i in range(20, 30)}  # only the 10 newest answers


def test_past_outputs_save_and_load_and_refuse_another_tokenizer(tmp_path, tiny):
    from specpipe.stores.manifest import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tiny.tokenizer)
    store = PastOutputs(max_tokens=500, fingerprint=fingerprint)
    for i in range(5):
        store.insert([10, 11, 12, 13 + i, 14])
    store.save(tmp_path / "past")
    loaded = PastOutputs.load(tmp_path / "past", fingerprint)
    assert len(loaded) == 5 and loaded.continuations([10, 11], 8, 4) == store.continuations([10, 11], 8, 4)
    with pytest.raises(StoreError, match="another tokenizer.*vocab_sha256"):
        PastOutputs.load(tmp_path / "past", {**fingerprint, "vocab_sha256": "0" * 32})
    (tmp_path / "past" / "tokens.npy").write_bytes(b"garbage")
    with pytest.raises(StoreError, match="tokens.npy"):
        PastOutputs.load(tmp_path / "past", fingerprint)


def test_past_outputs_take_inserts_from_many_threads():
    store = PastOutputs(max_tokens=1_000_000)

    def insert(worker: int) -> None:
        for i in range(200):
            store.insert([worker, i, 7, 8, 9])

    threads = [threading.Thread(target=insert, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == 800 and store.token_count == 4000
    assert len(store.continuations([7, 8], max_matches=10_000, max_length=1)) == 800


def test_a_repeated_request_drafts_from_its_earlier_answer(tiny_mixed):
    pipe = build_pipeline(tiny_mixed.config("vanilla", "+retriever@pipeline.proposers.past=past_outputs",
                                            "+tree@pipeline.tree=trie"), loaded=tiny_mixed.loaded)
    prompt = random_prompts(1, seed=21)[0]
    first = pipe.generate(prompt, max_new_tokens=24)
    second = pipe.generate(prompt, max_new_tokens=24)
    assert first.token_ids == second.token_ids == tiny_mixed.greedy_hf(prompt, 24)
    assert second.stats.steps < first.stats.steps and second.stats.mean_accepted > 2


def test_past_outputs_retriever_with_learning_off_keeps_the_store():
    retriever = PastOutputsRetriever(learn=False)
    state = DecodeState(tokens=[1, 2, 3, 4, 5], prompt_length=2)
    retriever.reset(state)
    retriever.on_finish(state)
    assert len(retriever.store) == 0
    learning = PastOutputsRetriever()
    learning.on_finish(state)
    assert len(learning.store) == 1 and learning.store.continuations([3, 4], 8, 4) == [(2, [5])]


# ---- drafting from retrieved chunks --------------------------------------------------------------
def test_documents_source_drafts_from_the_chunks_not_the_prompt():
    ngram = PromptNgram(name="retrieved_chunks", text="documents", max_matches=4, max_length=3)
    state = DecodeState(tokens=[50, 51, 7, 8], prompt_length=3, documents=((1, 7, 8, 9, 10), (7, 8, 20)))
    ngram.reset(state)
    proposal = ngram.propose(state)
    paths = {tuple(proposal.tokens[i: i + 1].tolist()) for i in range(len(proposal)) if proposal.parents[i] == -1}
    assert paths == {(9,), (20,)}  # what followed [7, 8] in either chunk; never across a document's end
    assert all(token != -1 for token in proposal.tokens.tolist())
    with pytest.raises(ValueError, match="text must be one of"):
        PromptNgram(text="web")


# ---- the RAG pipeline ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rag_tiny(tiny_mixed):
    return build_pipeline(tiny_mixed.config("rag_lookahead", "pipeline.proposers.past.learn=false",
                                            "+retriever@pipeline.proposers.chunks=retrieved_chunks",
                                            "pipeline.augment.draft_k=4"),
                          loaded=tiny_mixed.loaded)


def test_retrieve_returns_scored_chunks_best_first(rag_tiny):
    chunks = rag_tiny.retrieve("Which method of a context manager runs after the with block?", DOCUMENTS)
    assert len(chunks) == 4 and chunks[0].text.startswith("The with statement")
    assert [c.score for c in chunks] == sorted((c.score for c in chunks), reverse=True)
    assert len(rag_tiny.retrieve("What does yield do?", DOCUMENTS, k=50)) == len(DOCUMENTS)  # clamped
    store = DocumentStore.from_texts(DOCUMENTS)
    assert rag_tiny.retrieve("What does yield do?", store, k=1)[0].text.startswith("The yield statement")


def test_rag_prompt_holds_the_question_and_the_top_k_chunks(rag_tiny):
    prepared = rag_tiny.prepare("What is the difference between a list and a tuple?", documents=DOCUMENTS)
    text = rag_tiny.tokenizer.decode(prepared.token_ids)
    assert "Question: What is the difference between a list and a tuple?" in text
    assert "A list is a mutable sequence" in text  # the best chunk is in the prompt
    assert len(prepared.retrieved) == 4 and len(prepared.document_ids) == 4  # draft_k for drafting
    in_prompt = [chunk.text[:30] in text for chunk in prepared.retrieved]
    assert in_prompt == [True, True, True, False]  # k = 3 of them in the prompt


def test_rag_lookahead_is_lossless_on_the_tiny_model(rag_tiny, tiny_mixed):
    questions = ["Which method of a context manager runs after the with block?",
                 "How do I get a default value from a dictionary?", "What does yield do in a function?"]
    drafted = 0
    for question in questions:
        out = rag_tiny.generate(question, max_new_tokens=24, documents=DOCUMENTS)
        assert out.token_ids == tiny_mixed.greedy_hf(out.prompt_ids, 24), question
        assert out.retrieved and out.retrieved[0].score >= out.retrieved[-1].score
        drafted += out.stats.new_tokens - out.stats.steps
    assert drafted > 0  # drafts were accepted, not a vacuous pass


def test_documents_without_a_rag_pipeline_are_refused(tiny_mixed):
    pipe = tiny_mixed.pipeline("lookahead_trie")
    with pytest.raises(InvalidRequest, match="does not retrieve documents.*rag_lookahead"):
        pipe.generate("What is a tuple?", max_new_tokens=4, documents=DOCUMENTS)
    with pytest.raises(InvalidRequest, match="does not retrieve documents"):
        pipe.retrieve("What is a tuple?")


def test_rag_bad_input_is_refused(rag_tiny):
    with pytest.raises(InvalidRequest, match="non-empty question"):
        rag_tiny.retrieve("  ", DOCUMENTS)
    with pytest.raises(InvalidRequest, match="list of strings or a DocumentStore"):
        rag_tiny.retrieve("What is a tuple?", "just one string")
    with pytest.raises(InvalidRequest, match="all empty"):
        rag_tiny.retrieve("What is a tuple?", ["", "  "])
    with pytest.raises(InvalidRequest, match="token ids, which cannot be augmented"):
        rag_tiny.generate([400, 401, 402], max_new_tokens=2, documents=DOCUMENTS)
    with pytest.raises(Exception, match="k <= draft_k"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=rag_lookahead", "pipeline.augment.k=0"]))


@pytest.mark.embedded
def test_rag_lookahead_is_lossless_on_the_embedded_model(embedded):
    pipe = build_pipeline(embedded.config("rag_lookahead", "pipeline.proposers.past.learn=false"),
                          loaded=embedded.loaded)
    for question in ["Which method of a context manager runs after the with block?",
                     "What is the difference between a list and a tuple?"]:
        out = pipe.generate(question, max_new_tokens=48, documents=DOCUMENTS)
        assert out.token_ids == embedded.greedy_hf(out.prompt_ids, 48), question
        assert out.stats.mean_accepted > 1.2  # the answer copies from the chunks


@pytest.mark.embedded
def test_the_rag_example_application_runs():
    result = subprocess.run([sys.executable, str(REPO / "examples" / "rag_app.py"), "--max-new-tokens", "24"],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "retrieved:" in result.stdout and "answer:" in result.stdout and "mean accepted" in result.stdout


# ---- requests from several threads ---------------------------------------------------------------
@pytest.mark.parametrize("shared_calibration", [False, True])
@pytest.mark.parametrize("pipeline", ["lookahead_trie", "rag_lookahead"])
def test_parallel_requests_each_decode_as_they_would_alone(tiny_mixed, pipeline, shared_calibration):
    """Per-request state lives with the request: run in parallel threads, every request's tokens
    and per-step accepted counts equal its run alone (the shared store of past outputs off, and each
    request with its own acceptance calibration). With the calibration shared, as by default, the
    requests size each other's trees: the tokens still equal, the steps may not."""
    proposers = ["ngram", "past", "rest"] if pipeline == "rag_lookahead" else ["ngram"]
    overrides = [f"pipeline.proposers.{name}.shared_calibration={shared_calibration}" for name in proposers]
    if pipeline == "rag_lookahead":
        overrides.append("pipeline.proposers.past.learn=false")
    pipe = build_pipeline(tiny_mixed.config(pipeline, *overrides), loaded=tiny_mixed.loaded)
    prompts = random_prompts(8, seed=31)
    alone = []
    for prompt in prompts:
        tokens, steps = run_steps(pipe, prompt, 24)
        alone.append((tokens, [step.stats.accepted for step in steps]))
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def serve(i: int) -> None:
        try:
            tokens, steps = run_steps(pipe, prompts[i], 24)
            results[i] = (tokens, [step.stats.accepted for step in steps])
        except BaseException as error:  # reported below, with the thread's own traceback lost otherwise
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i, expected in enumerate(alone):
        if shared_calibration:
            assert results[i][0] == expected[0], f"request {i}'s tokens changed when run beside the others"
        else:
            assert results[i] == expected, f"request {i} changed when run beside the others"
    assert any(max(accepted) > 1 for _, accepted in alone)  # drafts were accepted: the state mattered


def test_malformed_messages_get_the_usual_message_in_a_rag_pipeline(rag_tiny):
    with pytest.raises(InvalidRequest, match="message 0 must be a dict with 'role' and 'content'"):
        rag_tiny.generate(["not a message"], max_new_tokens=2, documents=DOCUMENTS)


# ---- documents given with a request ---------------------------------------------------------------


class CountingEmbedder:
    """Words hashed into buckets (instant, deterministic), counting the texts it is asked to embed."""

    def __init__(self, name: str = "counting-test", dim: int = 64):
        self.dim = dim
        self.fingerprint = {"embedder": name, "dim": dim}
        self.embedded: list[str] = []

    def encode(self, texts, progress=False):
        import zlib

        import numpy as np

        texts = list(texts)
        self.embedded.extend(texts)
        out = np.full((len(texts), self.dim), 0.01, dtype=np.float32)  # [n, dim]
        for row, text in enumerate(texts):
            for word in text.lower().split():
                out[row, zlib.crc32(word.strip('.,?!()"').encode()) % self.dim] += 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def count_tokens(self, texts):
        return [len(text.split()) for text in texts]


def counting_rag(**options):
    from specpipe.stages.augment.rag_prompt import RagPrompt

    embedder = CountingEmbedder()
    rag = RagPrompt(store=DocumentStore.from_texts(["a placeholder store"], embedder=embedder), **options)
    embedder.embedded.clear()
    return rag, embedder


def summary(chunks):
    return [(chunk.chunk_id, chunk.text, chunk.score) for chunk in chunks]


def test_documents_must_be_strings_and_k_a_positive_integer():
    rag, _ = counting_rag(draft_k=4)
    question = "What does yield do?"
    expected = summary(rag.retrieve(question, DOCUMENTS))
    for given, named in (({"a": 1}, "dict"), ({"doc": "text"}, "dict"), (b"bytes", "bytes"), (42, "int"),
                         ("one string", "str"), (3.5, "float")):
        with pytest.raises(InvalidRequest, match=rf"documents must be .*got a {named}"):
            rag.retrieve(question, given)
    with pytest.raises(InvalidRequest, match=r"documents\[1\] is a int, not a string"):
        rag.retrieve(question, [DOCUMENTS[0], 3])
    with pytest.raises(InvalidRequest, match=r"documents\[0\] is a bytes"):
        rag.retrieve(question, (text.encode() for text in DOCUMENTS))
    # any other iterable of strings is read once, as the list it holds
    assert summary(rag.retrieve(question, (text for text in DOCUMENTS))) == expected
    assert summary(rag.retrieve(question, iter(DOCUMENTS))) == expected
    assert summary(rag.retrieve(question, tuple(DOCUMENTS))) == expected
    for k in ("3", 0, -1, True, 2.0):
        with pytest.raises(InvalidRequest, match=r"k must be a positive integer"):
            rag.retrieve(question, DOCUMENTS, k=k)
    assert len(rag.retrieve(question, DOCUMENTS, k=2)) == 2


def test_a_repeated_document_set_is_embedded_once():
    rag, embedder = counting_rag(draft_k=4)
    question = "Which method of a context manager runs after the with block?"
    first = summary(rag.retrieve(question, DOCUMENTS))
    embedded = len(embedder.embedded)
    assert embedded > len(DOCUMENTS)  # every chunk of every document and the question
    second = summary(rag.retrieve(question, list(DOCUMENTS)))
    assert second == first and len(embedder.embedded) == embedded  # nothing embedded again
    extra = "Sets hold unique hashable elements and support union and intersection."
    third = rag.retrieve("How do sets work?", [*DOCUMENTS, extra])
    assert sorted(embedder.embedded[embedded:]) == ["How do sets work?", extra]  # only what is new
    assert third[0].text == extra


def test_the_embedding_cache_is_bounded_and_keyed_by_the_embedder():
    import numpy as np

    from specpipe.stores.embedder import EmbeddingCache

    cache = EmbeddingCache(max_chunks=3)
    one, other = CountingEmbedder("one"), CountingEmbedder("other")
    texts = ["alpha beta", "gamma delta", "epsilon zeta"]
    vectors = cache.encode(one, texts)
    assert np.array_equal(vectors, one.encode(texts)) and len(cache) == 3
    one.embedded.clear()
    assert np.array_equal(cache.encode(one, ["gamma delta", "alpha beta", "gamma delta"]), one.encode(
        ["gamma delta", "alpha beta", "gamma delta"])[[0, 1, 0]]) and one.embedded == ["gamma delta", "alpha beta", "gamma delta"]
    one.embedded.clear()
    cache.encode(one, ["eta theta"])  # a fourth text: the least recently used one ("epsilon zeta") goes
    assert len(cache) == 3 and one.embedded == ["eta theta"]
    cache.encode(one, ["alpha beta", "epsilon zeta"])
    assert one.embedded == ["eta theta", "epsilon zeta"]
    cache.encode(other, ["alpha beta"])  # another embedder's vectors are its own
    assert other.embedded == ["alpha beta"]
    with pytest.raises(ValueError, match="max_chunks"):
        EmbeddingCache(max_chunks=-1)
