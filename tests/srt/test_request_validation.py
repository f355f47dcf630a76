"""Bad request data is a 400 at the HTTP edge and the server keeps serving (issue 15, item 2).

The checker functions are tested directly; one micro CPU server (``running_servers`` of
test_server_e2e) gets every bad request in turn, each followed by the same valid request, whose
output must not change. Without the checks the first bad id stops the server (the embedding gather
raises in the scheduler) and every later request fails to connect.
"""

from __future__ import annotations

import re

import pytest
import requests

from sglang_dsv4.srt import request_validation
from sglang_dsv4.srt.request_validation import logprob_fields_error, prompt_ids_error
from sglang_dsv4.tiny import preset_config
from test_server_e2e import Server, running_servers

VOCAB = preset_config("micro").vocab_size  # 129280, V4's
BAD_IDS = [VOCAB, 10**9, -1]
GOOD_IDS = [0, 11, 12, 13]


# ---- the checkers ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD_IDS)
def test_prompt_ids_error_names_field_index_id_and_vocab(bad):
    error = prompt_ids_error([0, 5, bad, 7, bad], VOCAB, field="input_ids[3]")
    assert error == (f"input_ids[3][2] = {bad} is not a token id of this model: token ids must be in "
                     f"[0, {VOCAB}) (vocabulary size {VOCAB})")


def test_prompt_ids_error_accepts_the_whole_range_and_refuses_empty():
    assert prompt_ids_error([0, 1, VOCAB - 1], VOCAB) is None
    assert prompt_ids_error([], VOCAB) == "input_ids is empty: a prompt needs at least one token"


def test_generate_body_check_names_bad_and_empty_prompts_and_leaves_malformed_ones(monkeypatch):
    monkeypatch.setattr(request_validation, "_vocab_size_if_ours", lambda: VOCAB)
    check = request_validation.generate_contract_error
    assert check(None, {"input_ids": [[0, 11], []]}) == "input_ids[1] is empty: a prompt needs at least one token"
    assert check(None, {"input_ids": [0, 11, VOCAB]}).startswith(f"input_ids[2] = {VOCAB} is not a token id")
    for malformed in ([0, 11.0, -1], [0, True, -1], [0, [1], -1]):  # the body parser's to refuse
        assert check(None, {"input_ids": malformed}) is None
    assert check(None, {"input_ids": GOOD_IDS}) is None and check("upstream's", {"input_ids": [-1]}) == "upstream's"


def test_logprob_fields_error_bounds():
    assert logprob_fields_error(0, -1, VOCAB) is None
    assert logprob_fields_error(VOCAB, 0, VOCAB) is None  # topk over the whole vocabulary is fine
    assert str(VOCAB + 1) in logprob_fields_error(VOCAB + 1, -1, VOCAB)
    assert "top_logprobs_num = -2" in logprob_fields_error(-2, -1, VOCAB)
    assert "logprob_start_len = -5" in logprob_fields_error(0, -5, VOCAB)


# ---- one server, every bad request ---------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, output ids of the valid request before any bad one)."""
    with running_servers(tmp_path_factory.mktemp("validation_server"), ("validation", [], None)) as (server,):
        yield server, server.generate(GOOD_IDS, max_new_tokens=4)["output_ids"]


def _completions(prompt, **extra) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}


def _generate(ids, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **extra}


def _case(path: str, body: dict, fragment: str, expected: str | None = None):
    name = f"{path}-{fragment}{'-stream' if body.get('stream') else ''}"
    return pytest.param(path, body, expected or fragment, id=name)


def _bad_id(path: str, body: dict, fragment: str):
    # the vocabulary size must be named along with the id (for VOCAB itself the id alone would match)
    return _case(path, body, fragment, f"{fragment} is not a token id of this model: token ids must be "
                                       f"in [0, {VOCAB}) (vocabulary size {VOCAB})")


CASES = [
    case for bad in BAD_IDS for case in (
        _bad_id("/generate", _generate([0, 11, bad]), f"input_ids[2] = {bad}"),
        _bad_id("/generate", _generate([[0, 11, 12], [0, bad]]), f"input_ids[1][1] = {bad}"),
        _bad_id("/generate", _generate([0, bad], stream=True), f"input_ids[1] = {bad}"),
        _bad_id("/v1/completions", _completions([0, 11, bad]), f"input_ids[2] = {bad}"),
        _bad_id("/v1/completions", _completions([[0, 11], [bad, 12]]), f"input_ids[0] = {bad}"),
        _bad_id("/v1/completions", _completions([0, bad], stream=True), f"input_ids[1] = {bad}"),
    )] + [  # each of these stopped the server too
    _case("/generate", _generate([[0, 11], []]), "input_ids[1] is empty"),
    _case("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}}, "the tokenized text is empty"),
    _case("/v1/completions", _completions([[0, 11], []]), "input_ids is empty"),
    _case("/generate", _generate([0, 11], return_logprob=True, top_logprobs_num=10**6), "top_logprobs_num = 1000000"),
    _case("/generate", _generate([0, 11], return_logprob=True, logprob_start_len=-5), "logprob_start_len = -5"),
]


def _post(server: Server, path: str, body: dict) -> requests.Response:
    with requests.post(server.url + path, json=body, timeout=120, stream=bool(body.get("stream"))) as r:
        r.content  # a stream that got past validation would be read to its end here
        return r


@pytest.mark.parametrize("path, body, message", CASES)
def test_bad_request_is_400_and_server_keeps_serving(served, path, body, message):
    server, before = served
    r = _post(server, path, body)
    assert r.status_code == 400, f"{path} {body}: HTTP {r.status_code} {r.text[:500]}"
    assert message in r.text, r.text
    assert server.proc.poll() is None, f"server exited:\n{server.log()[-3000:]}"
    assert server.generate(GOOD_IDS, max_new_tokens=4)["output_ids"] == before


def test_longest_admitted_request_stays_inside_the_cache(served):
    """The V4 cache raises past its max length (``SglangV4Cache.check_length``: SGLang's
    ``req_to_token`` width, context length + 4): SGLang's own bounds keep every request below it,
    so the edge needs no length check of ours. The longest prompt the scheduler admits, left to
    generate as much as it may, ends inside the context length."""
    server, before = served
    context_len = preset_config("micro").max_position_embeddings
    params = {"temperature": 0, "ignore_eos": True}  # no max_new_tokens: as many as SGLang allows
    r = requests.post(server.url + "/generate", json={"input_ids": [5] * (context_len - 1),
                                                      "sampling_params": params}, timeout=120)
    assert r.status_code == 400, r.text
    limit = int(re.search(r"maximum allowed length \((\d+) tokens\)", r.text).group(1))
    out = requests.post(server.url + "/generate", json={"input_ids": [5] * (limit - 1), "sampling_params": params},
                        timeout=300).json()
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == limit - 1 and meta["completion_tokens"] > 0, out
    assert meta["prompt_tokens"] + meta["completion_tokens"] < context_len
    assert server.generate(GOOD_IDS, max_new_tokens=4)["output_ids"] == before
