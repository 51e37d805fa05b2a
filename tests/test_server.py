"""The OpenAI-compatible server, live: a real `python run.py task=serve` on a free port, talked to over HTTP with
the official `openai` client and raw requests (the tiny model; one end-to-end test on the embedded one)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO
from test_bad_input import BAD_REQUESTS

PROMPT = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]


class LiveServer:
    """`run.py task=serve` in a subprocess, on the port it prints."""

    def __init__(self, *overrides: str) -> None:
        command = [sys.executable, str(REPO / "run.py"), "task=serve", "serve.port=0", "cost_curve=flat", *overrides]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        cwd=REPO)
        self.output: list[str] = []
        deadline = time.monotonic() + 180
        self.url = None
        while self.url is None:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("the server exited:\n" + "".join(self.output))
            self.output.append(line)
            found = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if found:
                self.url = found.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "".join(self.output))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, json.loads(reply.read()), dict(reply.headers)
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}"), dict(error.headers)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


@pytest.fixture(scope="module")
def server():
    live = LiveServer("model=tiny_random", "pipeline=lookahead_trie")
    yield live
    assert live.stop() == 0, "".join(live.output)


@pytest.fixture(scope="module")
def solo(tiny):
    """What the same pipeline answers in this process, alone (fp32 greedy: the server must give the same), its
    prefills row-invariant like the server's (whose prefix cache is on)."""
    pipe = tiny.pipeline("lookahead_trie", "prefix_cache.memory_mb=64")

    def answer(prompt, max_new_tokens: int, **kwargs):
        return pipe.generate(prompt, max_new_tokens=max_new_tokens, **kwargs)
    return answer


def test_chat_completion_with_the_openai_client(server, solo):
    completion = server.client().chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=20)
    expected = solo(PROMPT, 20)
    assert completion.choices[0].message.content == expected.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == len(expected.token_ids) == 20
    assert completion.usage.prompt_tokens == len(expected.prompt_ids)
    extension = completion.model_extra["specpipe"]
    assert extension["steps"] >= 1 and extension["mean_accepted_tokens"] > 0
    assert completion.model == "tiny_random" and completion.id.startswith("chatcmpl-")
    assert [model.id for model in server.client().models.list()] == ["tiny_random"]


def test_streamed_chat_gives_the_same_text_then_the_usage(server, solo):
    events = list(server.client().chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=20,
                                                          stream=True, stream_options={"include_usage": True}))
    text = "".join(event.choices[0].delta.content or "" for event in events if event.choices)
    assert text == solo(PROMPT, 20).text
    assert events[0].choices[0].delta.role == "assistant"
    reasons = [event.choices[0].finish_reason for event in events if event.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 20
    assert len([event for event in events if event.choices and event.choices[0].delta.content]) > 1


def test_completions_endpoint_and_stop_strings(server, solo):
    client = server.client()
    plain = solo("the cat sat on the mat, the cat", 16, chat_template=False).text
    completion = client.completions.create(model="tiny_random", prompt="the cat sat on the mat, the cat", max_tokens=16)
    assert completion.choices[0].text == plain
    stop = plain[len(plain) // 2:len(plain) // 2 + 3]
    cut = client.completions.create(model="tiny_random", prompt="the cat sat on the mat, the cat", max_tokens=16,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == plain[:plain.index(stop)]  # OpenAI's stop strings are not part of the text
    streamed = client.completions.create(model="tiny_random", prompt="the cat sat on the mat, the cat", max_tokens=16,
                                         stop=[stop], stream=True)
    assert "".join(event.choices[0].text for event in streamed) == cut.choices[0].text


def test_concurrent_requests_each_equal_their_solo_answer(server, solo):
    prompts = [[{"role": "user", "content": f"Count to {n} and then say the word {word}."}]
               for n, word in ((3, "apple"), (5, "river"), (7, "stone"), (4, "cloud"), (6, "lamp"), (2, "tree"))]
    answers = {}

    def ask(index: int) -> None:
        completion = server.client().chat.completions.create(model="tiny_random", messages=prompts[index],
                                                             max_tokens=24)
        answers[index] = completion.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [answers[index] for index in range(len(prompts))] == [solo(prompt, 24).text for prompt in prompts]


def bad_bodies():
    """test_bad_input's table of bad request values, as the fields of an OpenAI chat request."""
    cases = []
    for name, arguments, match in BAD_REQUESTS:
        body = {"model": "tiny_random", "messages": PROMPT, "max_tokens": 4}
        if "prompt" in arguments:
            prompt = arguments["prompt"]
            if not isinstance(prompt, list):
                continue  # a chat request's messages are a list by the API's own schema
            body["messages"] = prompt
        if "max_new_tokens" in arguments:
            body["max_tokens"] = arguments["max_new_tokens"]
        if "stop" in arguments:
            body["stop"] = arguments["stop"]
        if "sampling" in arguments:
            if not isinstance(arguments["sampling"], dict) or not set(arguments["sampling"]) <= {"temperature", "top_p",
                                                                                                 "seed", "top_k"}:
                continue
            body.update(arguments["sampling"])
        if set(arguments) - {"prompt", "max_new_tokens", "stop", "sampling"}:
            continue
        cases.append(pytest.param(body, match, id=name))
    cases += [pytest.param({"model": "tiny_random", "messages": PROMPT, key: value}, key, id=key)
              for key, value in (("logprobs", True), ("tools", [{"type": "function"}]), ("n", 2),
                                 ("frequency_penalty", 0.5), ("unknown_field", 1), ("response_format",
                                                                                    {"type": "json_object"}))]
    return cases


@pytest.mark.parametrize("body,match", bad_bodies())
def test_each_bad_field_gets_a_400_that_says_why(server, body, match):
    status, reply, _ = server.post("/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and match in reply["error"]["message"]


def test_what_is_not_a_request_is_refused(server):
    assert server.post("/v1/chat/completions", b"{not json")[0] == 400
    status, reply, _ = server.post("/v1/chat/completions", {"model": "gpt-4", "messages": PROMPT})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    import http.client
    from urllib.parse import urlparse

    address = urlparse(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("content-type", "application/json")
    connection.putheader("content-length", str(5 << 20))  # over the 4 MiB limit: refused before it is sent
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413 and "over" in json.loads(reply.read())["error"]["message"]
    connection.close()
    with pytest.raises(openai.BadRequestError, match="max_new_tokens"):
        server.client().chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=0)


def test_a_repeated_prompt_reuses_its_prefix_and_says_so(server, solo):
    """The second time a prompt comes, all its tokens' rows but the last one's come from the prefix cache: usage
    says how many, the prefix cache counters count them, and the answer is the same."""
    prompt = [{"role": "user", "content": "Name four colours of the rainbow, then four more things that are blue."}]
    client = server.client()
    before = server.metrics()
    first = client.chat.completions.create(model="tiny_random", messages=prompt, max_tokens=16)
    again = client.chat.completions.create(model="tiny_random", messages=prompt, max_tokens=16)
    after = server.metrics()
    prompt_tokens = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content == solo(prompt, 16).text
    grew = {name: after[(name, ())] - before.get((name, ()), 0.0)
            for name in ("specpipe:prefix_cache_queries_total", "specpipe:prefix_cache_hits_total")}
    assert grew["specpipe:prefix_cache_queries_total"] == 2 * prompt_tokens
    assert grew["specpipe:prefix_cache_hits_total"] == (first.usage.prompt_tokens_details.cached_tokens
                                                        + again.usage.prompt_tokens_details.cached_tokens)


def test_metrics_parse_and_move(server):
    before = server.metrics()
    server.client().chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=12)
    after = server.metrics()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("specpipe:requests_total", status="finished") == 1
    assert grew("specpipe:generation_tokens_total") == 12
    assert grew("specpipe:time_to_first_token_seconds_count") == 1
    assert grew("specpipe:spec_decode_num_drafts_total") >= 1
    assert grew("specpipe:spec_decode_num_accepted_tokens_total") >= grew(
        "specpipe:spec_decode_num_accepted_tokens_per_pos_total", position="1")
    assert ("specpipe:num_requests_running", ()) in after


def test_an_api_key_is_required_when_set():
    live = LiveServer("model=tiny_random", "pipeline=vanilla", "serve.api_key=sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client().chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="sesame2").models.list()
        status, reply, _ = live.post("/v1/chat/completions", {"model": "tiny_random", "messages": PROMPT})
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        answer = live.client(api_key="sesame").chat.completions.create(model="tiny_random", messages=PROMPT,
                                                                        max_tokens=2)
        assert answer.usage.completion_tokens == 2
        assert urllib.request.urlopen(f"{live.url}/health", timeout=10).status == 200
    finally:
        assert live.stop() == 0


def test_a_full_queue_answers_429_a_closed_stream_frees_its_place_and_sigterm_exits_0():
    live = LiveServer("model=tiny_random", "pipeline=vanilla", "scheduler.max_sequences=1", "scheduler.max_queued=1",
                      "serve.grace_seconds=60")
    try:
        client = live.client()
        long = client.chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=1800, stream=True)
        next(iter(long))  # running: the one place is taken
        waiting = threading.Thread(target=lambda: client.chat.completions.create(
            model="tiny_random", messages=PROMPT, max_tokens=2))
        waiting.start()
        deadline = time.monotonic() + 30
        while live.metrics().get(("specpipe:num_requests_waiting", ()), 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, reply, headers = live.post("/v1/chat/completions", {"model": "tiny_random", "messages": PROMPT,
                                                                    "max_tokens": 2})
        assert status == 429 and "queue is full" in reply["error"]["message"] and headers.get("retry-after") == "1"
        long.close()  # the client goes away mid-stream
        waiting.join(timeout=60)
        assert not waiting.is_alive()  # the place came back
        deadline = time.monotonic() + 30
        while live.metrics().get(("specpipe:requests_total", (("status", "cancelled"),)), 0) < 1:
            assert time.monotonic() < deadline, "the closed stream's request was not cancelled"
            time.sleep(0.05)
        running = client.chat.completions.create(model="tiny_random", messages=PROMPT, max_tokens=400, stream=True)
        next(iter(running))
        live.process.send_signal(signal.SIGTERM)  # a running request finishes within the grace period
        text = "".join(event.choices[0].delta.content or "" for event in running if event.choices)
        assert text  # its stream ended with the rest of its answer
        assert live.process.wait(timeout=60) == 0
        assert "every request finished" in "".join(live.output)
    finally:
        live.stop()


def test_the_rag_example_talks_to_a_live_server():
    live = LiveServer("model=tiny_random", "pipeline=rag_lookahead", "pipeline.proposers.past.learn=false")
    try:
        result = subprocess.run([sys.executable, str(REPO / "examples" / "rag_client.py"), "--base-url",
                                 f"{live.url}/v1", "--model", "tiny_random", "--max-tokens", "16"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "retrieved:" in result.stdout and "answer:" in result.stdout and "streamed:" in result.stdout
        first = next(line for line in result.stdout.splitlines() if line.startswith("retrieved:"))
        assert first.endswith("document 1")  # the expense-report paragraph answers the expense question
    finally:
        assert live.stop() == 0


@pytest.mark.embedded
def test_the_embedded_model_served_end_to_end(embedded):
    live = LiveServer("model=smollm2_135m", "pipeline=lookahead_trie")
    try:
        question = [{"role": "user", "content": "Name three primary colors."}]
        completion = live.client().chat.completions.create(model="smollm2_135m", messages=question, max_tokens=32)
        expected = embedded.pipeline("lookahead_trie").generate(question, max_new_tokens=32)
        assert completion.choices[0].message.content == expected.text
        assert completion.usage.completion_tokens == len(expected.token_ids)
    finally:
        assert live.stop() == 0


def test_langchain_chat_openai_talks_to_the_server(server, solo):
    """A RAG application on LangChain points ChatOpenAI at the server and invokes and streams it."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="tiny_random", max_tokens=20, max_retries=0)
    reply = llm.invoke(PROMPT[0]["content"])
    assert reply.content == solo(PROMPT, 20).text
    assert reply.usage_metadata["output_tokens"] == 20
    assert "".join(part.content for part in llm.stream(PROMPT[0]["content"])) == reply.content
