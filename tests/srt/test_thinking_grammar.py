"""The think-budget grammar (``srt/thinking.py``) on its own: xgrammar's GrammarMatcher with the
real V4 tokenizer, random walks over the allowed tokens (what random weights do), no server."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sglang_dsv4.srt import thinking as th
from sglang_dsv4.tokenizer_files import EOS_TOKEN_ID, THINK_END_ID, THINK_START_ID, write_tokenizer_files

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "note": {"type": "string", "maxLength": 6}},
          "required": ["answer", "confidence", "note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tokenizer_files(tmp_path_factory.mktemp("tok"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=129280, stop_token_ids=[EOS_TOKEN_ID])
    specials = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return tokenizer, xgr.GrammarCompiler(info), specials


def _allowed(matcher, vocab: int = 129280) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32)) & 1
    return torch.nonzero(bits.flatten()[:vocab]).flatten()


def _walk(compiler, tag: dict, seed: int, max_steps: int, close_p: float = 0.0,
          answer_exclude: list[int] = ()) -> list[int]:
    """Random tokens among the allowed ones (plus the answer-side mask the scheduler adds)."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    rng, out = random.Random(seed), []
    banned = set(answer_exclude)
    for _ in range(max_steps):
        allowed = _allowed(matcher).tolist()
        if THINK_END_ID in out:
            allowed = [t for t in allowed if t not in banned]
        if not allowed:
            break
        if THINK_END_ID in allowed and THINK_END_ID not in out and rng.random() < close_p:
            token = THINK_END_ID
        else:
            token = rng.choice(allowed)
        assert matcher.accept_token(token)
        out.append(token)
        if token == EOS_TOKEN_ID or matcher.is_terminated():
            break
    return out


@pytest.mark.parametrize("budget", [0, 1, 7, 64])
def test_budget_bounds_think_and_json_answer_validates(tok, budget):
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer, compiler, specials = tok
    closing = tokenizer.encode(th.DEFAULT_CLOSING_TEXT, add_special_tokens=False)
    answer = th.answer_format(json_schema=json.dumps(SCHEMA), max_whitespace=1)
    tag = th.build_structural_tag(budget, answer, special_ids=specials, closing_ids=closing)
    for seed in range(3):
        out = _walk(compiler, tag, seed, budget + 200, answer_exclude=th.answer_exclusions(specials))
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= budget, (budget, seed, think, ends)
        if budget > len(closing) and think == budget:  # ran out: the closing text was forced
            assert out[think - len(closing):think] == closing
        assert out[-1] == EOS_TOKEN_ID
        jsonschema.validate(json.loads(tokenizer.decode(out[think + 1:-1])), SCHEMA)
        assert not set(out[:think]) & set(specials), "a special token inside the think section"
        assert not set(out[think + 1:-1]) & set(specials), "a special token inside the answer"


def test_model_may_close_early_and_free_text_answer(tok):
    tokenizer, compiler, specials = tok
    closing = tokenizer.encode(th.DEFAULT_CLOSING_TEXT, add_special_tokens=False)
    answer = th.answer_format(exclude_tokens=th.answer_exclusions(specials))
    tag = th.build_structural_tag(40, answer, special_ids=specials, closing_ids=closing)
    lengths = []
    for seed in range(6):
        out = _walk(compiler, tag, seed, 80, close_p=0.1)
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= 40
        assert not set(out[think + 1:]) & (set(specials) - {EOS_TOKEN_ID})
        lengths.append(think)
    assert min(lengths) < 40 - len(closing), "an early </think> was never allowed"


def test_regex_and_ebnf_answers(tok):
    tokenizer, compiler, specials = tok
    for answer, check in ((th.answer_format(regex=r"(yes|no)\.[0-9]"), r"^(yes|no)\.[0-9]$"),
                          (th.answer_format(ebnf='root ::= "A" [0-9] [0-9]'), r"^A[0-9][0-9]$")):
        import re

        tag = th.build_structural_tag(5, answer, special_ids=specials)
        out = _walk(compiler, tag, 1, 40)
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= 5
        assert re.match(check, tokenizer.decode(out[think + 1:-1]))


def test_unbounded_think_still_closes_with_the_token_and_excludes_specials(tok):
    _, compiler, specials = tok
    tag = th.build_structural_tag(None, th.answer_format(exclude_tokens=th.answer_exclusions(specials)),
                                  special_ids=specials)
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    allowed = set(_allowed(matcher).tolist())
    assert THINK_END_ID in allowed and THINK_START_ID not in allowed and EOS_TOKEN_ID not in allowed


def test_open_think_length_and_effective_budget():
    assert th.open_think_length([0, 5, THINK_START_ID]) == 0
    assert th.open_think_length([0, THINK_START_ID, 7, 8, 9]) == 3
    assert th.open_think_length([0, THINK_START_ID, 7, THINK_END_ID, 4]) is None
    assert th.open_think_length([0, 5, 6]) is None
    assert th.text_opens_think("q<think>") and th.text_opens_think("<think>a</think>b<think>c")
    assert not th.text_opens_think("<think>a</think>b") and not th.text_opens_think("plain")
    assert th.effective_budget(64, 0, 128, 0.25) == 64
    assert th.effective_budget(400, 0, 128, 0.25) == 128 - 1 - 32
    assert th.effective_budget(400, 0, 144, 0.5) == 71
    assert th.effective_budget(10, 4, None, 0.25) == 6
    assert th.effective_budget(3, 9, None, 0.25) == 0
    assert th.effective_budget(None, 0, None, 0.25) is None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(thinking=None, budgets={"thinking_budget": -1}), "thinking_budget must be >= 0"),
    (dict(thinking=None, budgets={"thinking_budget": 7.5}), "thinking_budget must be a non-negative integer"),
    (dict(thinking=None, budgets={"max_thinking_tokens": "8"}), "max_thinking_tokens must be"),
    (dict(thinking=None, budgets={"thinking_budget": True}), "thinking_budget must be"),
    (dict(thinking=False, budgets={"thinking_budget": 16}), "chat_template_kwargs.thinking is false"),
    (dict(thinking="yes", budgets={}), "chat_template_kwargs.thinking must be true or false"),
    (dict(thinking=None, budgets={"thinking_budget": 4, "max_thinking_tokens": 5}), "conflicting"),
    (dict(thinking=True, budgets={}, reasoning_effort="extreme"), "reasoning_effort must be one of"),
])
def test_bad_chat_fields_name_the_field(kwargs, fragment):
    kwargs.setdefault("reasoning_effort", None)
    with pytest.raises(th.ThinkingRequestError, match=fragment):
        th.resolve_chat_thinking(settings=th.ThinkingSettings.from_env({}), **kwargs)


def test_chat_budget_resolution_and_effort_table():
    s = th.ThinkingSettings.from_env({"SGLANG_DSV4_THINKING_EFFORT_BUDGETS": '{"low": 99}'})
    r = th.resolve_chat_thinking
    assert r(thinking=None, budgets={"thinking_budget": 5}, reasoning_effort=None, settings=s) == th.ChatThinking(True, 5)
    assert r(thinking=False, budgets={"thinking_budget": 0}, reasoning_effort=None, settings=s) == th.ChatThinking(False, 0)
    assert r(thinking=True, budgets={}, reasoning_effort="low", settings=s).budget == 99
    assert r(thinking=True, budgets={}, reasoning_effort="none", settings=s).budget == 0
    assert r(thinking=True, budgets={}, reasoning_effort="max", settings=s).budget is None
    assert r(thinking=True, budgets={"thinking_budget": 3}, reasoning_effort="max", settings=s).budget == 3
    assert r(thinking=None, budgets={}, reasoning_effort="low", settings=s) == th.ChatThinking(None, None)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(json_schema="{not json"), "invalid response_format.json_schema"),
    (dict(json_schema='{"type": "objekt"}'), "invalid response_format.json_schema"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(ebnf="root ::= "), "invalid ebnf"),
])
def test_invalid_answer_constraints(kwargs, fragment):
    with pytest.raises(th.ThinkingRequestError, match=fragment):
        th.answer_format(**kwargs)
