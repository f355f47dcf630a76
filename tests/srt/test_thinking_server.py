"""Think budgets end to end: the micro V4 (random weights think forever when allowed) on CPU.

One module, three servers started once (in parallel): ours (``--reasoning-parser deepseek-v4``,
the plugin's grammar-bounded budget), upstream's ``--enable-strict-thinking`` mode, which gets the
very same requests (our hooks stand aside on that server), and ours with ``--grammar-backend
none``, which cannot enforce a budget and must say so. Requests are few and short.
"""

from __future__ import annotations

import json
import os

import pytest
import requests

from sglang_dsv4.srt.thinking import count_think_tokens
from sglang_dsv4.tokenizer_files import THINK_END_ID, THINK_START_ID
from test_server_e2e import Server, running_servers

jsonschema = pytest.importorskip("jsonschema")

# fixed ports only when asked for; by default free ones, so concurrent test runs never share a server
PORT_BASE = int(os.environ["SGLANG_DSV4_TEST_PORT_BASE"]) if "SGLANG_DSV4_TEST_PORT_BASE" in os.environ else None
MAX_TOKENS = 144
# A budget that would crowd out the answer is cut so that ceil(0.5 * 144) = 72 tokens remain for
# </think> + answer: a budget of 200 (> max_tokens) thinks at most 71 tokens, 64 is untouched.
CLAMPED = MAX_TOKENS - 1 - 72
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}
PARSER = ["--reasoning-parser", "deepseek-v4", "--enable-cache-report"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers(tmp_path_factory.mktemp("thinking_servers"),
                         ("ours", PARSER, PORT_BASE),
                         ("upstream_strict", PARSER + ["--enable-strict-thinking"],
                          None if PORT_BASE is None else PORT_BASE + 1),
                         ("no_grammar", PARSER + ["--grammar-backend", "none"],
                          None if PORT_BASE is None else PORT_BASE + 2)) as started:
        yield started


def chat_body(budget: int | None, *, schema: bool = True, messages=None, **extra) -> dict:
    body = {"model": "default", "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": messages or [{"role": "user", "content": "Is 7 a prime number? Reply in JSON."}],
            "chat_template_kwargs": {"thinking": True}, **extra}
    if budget is not None:
        body["thinking_budget"] = budget
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    return body


def chat(server: Server, body: dict) -> dict:
    r = requests.post(server.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server: Server, body: dict) -> tuple[str, str]:
    r = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=600)
    assert r.status_code == 200, r.text
    reasoning = content = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning, content


@pytest.mark.parametrize("budget, stream", [(0, True), (1, False), (7, True), (64, False), (200, True)])
def test_budget_bounds_think_and_json_validates(servers, budget, stream):
    ours = servers[0]
    body = chat_body(budget)
    out = chat(ours, body)
    choice = out["choices"][0]
    ids = choice["response_token_ids"]
    assert choice["prompt_token_ids"][-1] == THINK_START_ID  # thinking on: the output starts inside it
    think, ends = count_think_tokens(ids)
    assert ends == 1, f"budget {budget}: </think> appears {ends} times"
    assert think <= min(budget, CLAMPED), f"budget {budget}: thought {think} tokens"
    assert THINK_START_ID not in ids
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert "</think>" not in (message["reasoning_content"] or "") + message["content"]
    if stream:
        reasoning, content = chat_stream(ours, body)
        assert (reasoning, content) == ((message["reasoning_content"] or ""), message["content"])


def test_free_text_answer_and_reasoning_effort_budget(servers, monkeypatch):
    ours = servers[0]
    # reasoning_effort "none" maps to budget 0 (README table): the first token closes thinking
    out = chat(ours, chat_body(None, schema=False, reasoning_effort="none", max_tokens=12))
    ids = out["choices"][0]["response_token_ids"]
    assert ids[0] == THINK_END_ID and count_think_tokens(ids)[1] == 1
    # an explicit budget wins over the effort; no schema: free text after </think>
    out = chat(ours, chat_body(3, schema=False, reasoning_effort="max", max_tokens=12))
    ids = out["choices"][0]["response_token_ids"]
    think, ends = count_think_tokens(ids)
    assert think <= 3 and ends == 1
    assert out["usage"]["completion_tokens"] == len(ids)


def test_native_generate_budget_counts_the_prompts_open_reasoning(servers):
    ours = servers[0]
    prompt = [0, 128803, 4910, 223, 25, 4309, 128804, THINK_START_ID]  # <BOS><User>...<Assistant><think>
    for already, budget in ((0, 5), (3, 5), (6, 5)):
        ids = prompt + [4910] * already  # a continued assistant message with open reasoning
        r = requests.post(ours.url + "/generate", timeout=600, json={
            "input_ids": ids, "max_thinking_tokens": budget,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "regex": "(yes|no)"}})
        assert r.status_code == 200, r.text
        out = r.json()["output_ids"]
        think, ends = count_think_tokens(out)
        assert ends == 1 and think <= max(0, budget - already), (already, out)
        assert r.json()["text"].split("</think>")[-1] in ("yes", "no")


def test_later_turn_hits_the_cache_and_resumes_exactly(servers):
    ours = servers[0]
    first = chat(ours, chat_body(7))
    reply = first["choices"][0]["message"]["content"]
    turn2 = chat_body(7, messages=[{"role": "user", "content": "Is 7 a prime number? Reply in JSON."},
                                   {"role": "assistant", "content": reply},
                                   {"role": "user", "content": "And 9?"}])
    second = chat(ours, turn2)
    # V4 drops reasoning from history: turn 2 continues turn 1's prompt right before its <think>
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
    ids = second["choices"][0]["response_token_ids"]
    think, ends = count_think_tokens(ids)
    assert ends == 1 and think <= 7
    jsonschema.validate(json.loads(second["choices"][0]["message"]["content"]), SCHEMA)
    # resumed from the snapshot == a cold run (cache flushed), grammar state included. The flush
    # waits (timeout) for the scheduler to go idle: a reply can arrive before its request has left
    # the running batch, and a flush then is refused with 400 (CI, stop 48)
    assert requests.post(ours.url + "/flush_cache", params={"timeout": 30}, timeout=60).status_code == 200
    cold = chat(ours, turn2)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"] - 1
    assert cold["choices"][0]["response_token_ids"] == ids


@pytest.mark.parametrize("path, body, fragment", [
    ("chat", chat_body(-1), "thinking_budget must be >= 0"),
    ("chat", chat_body(7.5), "thinking_budget must be a non-negative integer"),
    ("chat", chat_body(None, max_thinking_tokens="64"), "max_thinking_tokens must be a non-negative integer"),
    ("chat", {**chat_body(16), "chat_template_kwargs": {"thinking": False}}, "chat_template_kwargs.thinking is false"),
    ("chat", {**chat_body(16, stream=True), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "invalid response_format.json_schema"),
    ("generate", {"input_ids": [0, 5, THINK_START_ID], "max_thinking_tokens": -3,
                  "sampling_params": {"max_new_tokens": 4}}, "max_thinking_tokens must be >= 0"),
    ("generate", {"input_ids": [0, 5, THINK_START_ID], "stream": True,
                  "sampling_params": {"max_new_tokens": 4, "custom_params": {"thinking_budget": 2.5}}},
     "thinking_budget must be a non-negative integer"),
    ("generate", {"input_ids": [0, 5, 6], "max_thinking_tokens": 4, "sampling_params": {"max_new_tokens": 4}},
     "does not end inside a think section"),
    ("generate", {"input_ids": [0, 5, 6], "stream": True,  # a 400, not an error event in the stream
                  "sampling_params": {"max_new_tokens": 4, "custom_params": {"thinking_budget": 4}}},
     "does not end inside a think section"),
    ("generate", {"text": "<think>a</think> answer", "max_thinking_tokens": 4, "stream": True,
                  "sampling_params": {"max_new_tokens": 4}}, "does not end inside a think section"),
])
def test_bad_input_is_http_400_naming_the_field(servers, path, body, fragment):
    ours = servers[0]
    url = ours.url + ("/v1/chat/completions" if path == "chat" else "/generate")
    r = requests.post(url, json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert fragment in r.text


def test_upstream_strict_thinking_on_v4_same_requests(servers):
    """Upstream's own bound (custom_params.thinking_budget) on our V4, side by side with ours."""
    ours, upstream = servers[:2]
    for budget in (0, 7, 64):
        body = {**chat_body(None), "custom_params": {"thinking_budget": budget}}
        theirs = chat(upstream, body)["choices"][0]
        think, ends = count_think_tokens(theirs["response_token_ids"])
        # upstream's bound holds on V4 (its V4 detector ends thinking on the </think> token) ...
        assert ends == 1 and think <= budget, (budget, think, ends)
        jsonschema.validate(json.loads(theirs["message"]["content"]), SCHEMA)
        if budget == 7:  # ... and our server reads the very same field
            mine = count_think_tokens(chat(ours, body)["choices"][0]["response_token_ids"])
            assert mine[0] <= 7 and mine[1] == 1
    # a budget larger than max_tokens: upstream thinks until the length cut, with no answer at all
    body = {**chat_body(None, max_tokens=40), "custom_params": {"thinking_budget": 200}}
    theirs = chat(upstream, body)["choices"][0]
    think, ends = count_think_tokens(theirs["response_token_ids"])
    assert (ends, theirs["finish_reason"]) == (0, "length") and think == 40
    # upstream silently ignores a budget that is not an integer (ours answers 400)
    r = requests.post(upstream.url + "/v1/chat/completions", timeout=600,
                      json={**chat_body(None, max_tokens=4), "custom_params": {"thinking_budget": "7"}})
    assert r.status_code == 200


def test_frontend_language_program_with_a_budget(servers):
    import sglang as sgl

    from sglang_dsv4.lang import ThinkingEndpoint

    @sgl.function
    def verdict(s, question):
        s += "<｜begin▁of▁sentence｜><｜User｜>" + question + "<｜Assistant｜><think>"
        s += sgl.gen("out", max_tokens=16, temperature=0, regex="(yes|no)")

    ours = servers[0]
    # budget 0 through the frontend: the first generated token is </think> (dropped from the text
    # when special tokens are skipped), then the regex answer; any thinking would add text
    state = verdict.run(question="Is 7 prime?", backend=ThinkingEndpoint(ours.url, thinking_budget=0))
    assert state["out"].removeprefix("</think>") in ("yes", "no"), state["out"]


def _think_len(meta: dict) -> tuple[int, int]:
    """(think tokens, number of </think>) of a frontend gen's output (its returned token ids)."""
    return count_think_tokens([entry[1] for entry in meta["output_token_logprobs"]])


def test_per_gen_budgets_bound_each_branch_of_a_forked_program(servers):
    import sglang as sgl

    from sglang_dsv4.lang import ThinkingEndpoint, gen

    budgets = (0, 2, 9)

    @sgl.function
    def branches(s, question):
        s += "<｜begin▁of▁sentence｜><｜User｜>" + question + "<｜Assistant｜><think>"
        forks = s.fork(len(budgets))
        for f, budget in zip(forks, budgets):
            f += gen("out", max_tokens=40, temperature=0, regex="(yes|no)", return_logprob=True,
                     max_thinking_tokens=budget)
        return [f.get_meta_info("out") for f in forks]

    ours = servers[0]
    # the endpoint's default (64) is overridden by each gen's own budget
    state = branches.run(question="Is 7 prime?", backend=ThinkingEndpoint(ours.url, thinking_budget=64))
    lengths = []
    for budget, meta in zip(budgets, state.ret_value):
        think, ends = _think_len(meta)
        assert ends == 1 and think <= budget, (budget, think, ends)
        lengths.append(think)
    # random weights think until forced: each branch used its own budget, not a shared one
    assert lengths == list(budgets)


def test_gen_budget_needs_our_endpoint():
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from sglang_dsv4.lang import ThinkingEndpoint, gen

    with pytest.raises(ValueError, match="max_thinking_tokens must be a non-negative integer"):
        gen("x", max_thinking_tokens=-1)
    with pytest.raises(ValueError, match="choices"):
        gen("x", choices=["a", "b"], max_thinking_tokens=3)
    expr = gen("x", max_tokens=4, max_thinking_tokens=3, dtype=int)
    params = expr.sampling_params
    assert ThinkingEndpoint._take_budget(params) == 3 and params.dtype is int  # taken back out
    budgeted = gen("x", max_tokens=4, max_thinking_tokens=3).sampling_params
    with pytest.raises(RuntimeError, match="Invalid dtype"):  # a plain endpoint refuses, never ignores
        RuntimeEndpoint._handle_dtype_to_regex(None, budgeted)
    assert isinstance(sgl.gen("x"), type(expr))


def test_fork_point_is_filled_on_the_first_run(servers):
    """A program that forks right after adding text (not synced): every branch's prompt hits the
    fork point on the very first run (the text is new to the server)."""
    import random

    import sglang as sgl

    from sglang_dsv4.lang import ThinkingEndpoint

    rng = random.Random()
    words = " ".join(rng.choice(["red", "green", "blue", "seven", "nine", "prime"]) for _ in range(120))

    @sgl.function
    def three(s):
        s += "Notes: " + words + "\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Answer {i}:" + sgl.gen("a", max_tokens=2, temperature=0)
        return [f.get_meta_info("a") for f in forks]

    ours = servers[0]
    metas = three.run(backend=ThinkingEndpoint(ours.url)).ret_value
    for meta in metas:
        # all but the branch's own suffix ("Answer i:", a few tokens) came from the cache
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 6, metas


@pytest.mark.parametrize("path, body, fragment", [
    ("chat", chat_body(16), "thinking_budget: a thinking budget is enforced by the grammar backend"),
    ("chat", chat_body(None, schema=False, reasoning_effort="high"), "reasoning_effort: "),
    ("chat", {**chat_body(None, schema=False), "custom_params": {"thinking_budget": 0}},
     "custom_params.thinking_budget: "),
    ("generate", {"input_ids": [0, 5, THINK_START_ID], "max_thinking_tokens": 4,
                  "sampling_params": {"max_new_tokens": 4}}, "max_thinking_tokens: "),
    ("generate", {"input_ids": [0, 5, THINK_START_ID], "stream": True,
                  "sampling_params": {"max_new_tokens": 4, "custom_params": {"thinking_budget": 4}}},
     "sampling_params.custom_params.thinking_budget: "),
])
def test_a_budget_the_server_cannot_enforce_is_a_400_saying_so(servers, path, body, fragment):
    no_grammar = servers[2]
    url = no_grammar.url + ("/v1/chat/completions" if path == "chat" else "/generate")
    r = requests.post(url, json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert fragment in r.text and "--grammar-backend none" in r.text, r.text


def test_no_budget_still_serves_without_a_grammar_backend(servers):
    no_grammar = servers[2]
    out = chat(no_grammar, chat_body(None, schema=False, max_tokens=6))
    assert out["choices"][0]["finish_reason"] == "length"
