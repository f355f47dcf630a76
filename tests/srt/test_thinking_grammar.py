"""The think-budget grammar on its own: our grammar object (``srt/thinking_grammar.py``) made by
SGLang's real ``XGrammarGrammarBackend`` through our dispatch hook, with the real V4 tokenizer;
random walks over the allowed tokens (what random weights do), no server. Also the request-field
rules of ``srt/thinking.py`` and the HTTP side's can-this-server-enforce-it check."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from sglang_dsv4.srt import thinking as th
from sglang_dsv4.tokenizer_files import EOS_TOKEN_ID, THINK_END_ID, THINK_START_ID, write_tokenizer_files

xgr = pytest.importorskip("xgrammar")

VOCAB = 129280
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "note": {"type": "string", "maxLength": 6}},
          "required": ["answer", "confidence", "note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tokenizer_files(tmp_path_factory.mktemp("tok"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return tokenizer, th.special_token_ids(tokenizer)


@pytest.fixture(scope="module")
def backend(tok):
    """SGLang's xgrammar backend as the scheduler builds it, with our __init__ hook applied."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from sglang_dsv4.srt import thinking_grammar as tg

    b = XGrammarGrammarBackend(tok[0], vocab_size=VOCAB, model_eos_token_ids=[EOS_TOKEN_ID])
    tg.prepare_backend(None, b, tok[0])
    return b


def _grammar(backend, bound: th.ThinkBound):
    """The scheduler's path: dispatch_structural_tag(key) with our AROUND hook."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from sglang_dsv4.srt import thinking_grammar as tg

    g = tg.dispatch_structural_tag(XGrammarGrammarBackend.dispatch_structural_tag, backend, bound.to_key())
    assert isinstance(g, tg.ThinkBudgetGrammar), g
    return g.copy()  # SGLang caches the dispatched object and serves each request a copy


def _allowed(grammar) -> list[int]:
    mask = grammar.allocate_vocab_mask(VOCAB, 2, "cpu")
    grammar.fill_vocab_mask(mask, 1)
    bits = (mask[1].unsqueeze(-1) >> torch.arange(32)) & 1
    return torch.nonzero(bits.flatten()[:VOCAB]).flatten().tolist()


def _walk(grammar, seed: int, max_steps: int, close_p: float = 0.0) -> list[int]:
    """Random tokens among the allowed ones until the grammar terminates."""
    rng, out = random.Random(seed), []
    for _ in range(max_steps):
        allowed = _allowed(grammar)
        if not allowed:
            break
        if THINK_END_ID in allowed and THINK_END_ID not in out and rng.random() < close_p:
            token = THINK_END_ID
        else:
            token = rng.choice(allowed)
        grammar.accept_token(token)
        out.append(token)
        if grammar.is_terminated():
            break
    return out


def _closing(tok) -> list[int]:
    return tok[0].encode(th.DEFAULT_CLOSING_TEXT, add_special_tokens=False)


@pytest.mark.parametrize("budget", [0, 1, 7, 64])
def test_budget_bounds_think_and_json_answer_validates(tok, backend, budget):
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer, specials = tok
    closing = _closing(tok)
    answer = th.answer_format(json_schema=json.dumps(SCHEMA), max_whitespace=1)
    bound = th.ThinkBound.make(budget, answer, special_ids=specials, closing_ids=closing)
    for seed in range(3):
        out = _walk(_grammar(backend, bound), seed, budget + 200)
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= budget, (budget, seed, think, ends)
        if budget > len(closing) and think == budget:  # ran out: the closing text was forced
            assert out[think - len(closing):think] == closing
        assert out[-1] == EOS_TOKEN_ID
        jsonschema.validate(json.loads(tokenizer.decode(out[think + 1:-1])), SCHEMA)
        assert not set(out[:think]) & set(specials), "a special token inside the think section"
        assert not set(out[think + 1:-1]) & set(specials), "a special token inside the answer"


def test_budget_shorter_than_the_closing_text_forces_the_end_token_alone(tok, backend):
    closing = _closing(tok)
    budget = len(closing) - 2
    bound = th.ThinkBound.make(budget, th.answer_format(), special_ids=tok[1], closing_ids=closing)
    assert bound.closing_ids == ()
    g = _grammar(backend, bound)
    for _ in range(budget):
        assert THINK_END_ID in _allowed(g) and len(_allowed(g)) > 1000
        g.accept_token(4910)
    assert _allowed(g) == [THINK_END_ID]


def test_huge_budget_is_exact_at_its_end(tok, backend):
    """32768 think tokens (accepted without masks, cheap), then the forced closing and </think>."""
    closing = _closing(tok)
    bound = th.ThinkBound.make(32768, th.answer_format(regex="(yes|no)"), special_ids=tok[1], closing_ids=closing)
    g = _grammar(backend, bound)
    for _ in range(32768 - len(closing)):
        g.accept_token(4910)
    assert THINK_START_ID not in _allowed(g)
    for t in closing:
        assert _allowed(g) == [t]
        g.accept_token(t)
    assert _allowed(g) == [THINK_END_ID]
    with pytest.raises(ValueError, match="not allowed"):
        g.accept_token(4910)
    g.accept_token(THINK_END_ID)
    assert th.count_think_tokens([4910] * (32768 - len(closing)) + closing + [THINK_END_ID]) == (32768, 1)
    assert tok[0].decode(_walk(g, 0, 10)[:-1]) in ("yes", "no")


def test_rollback_restores_every_phase(tok, backend):
    bound = th.ThinkBound.make(20, th.answer_format(regex="(yes|no)"), special_ids=tok[1], closing_ids=_closing(tok))
    g = _grammar(backend, bound)
    ids = [4910, 4910, 4910, THINK_END_ID] + tok[0].encode("yes", add_special_tokens=False)
    for t in ids:
        g.accept_token(t)
    before = _allowed(g)
    g.accept_token(EOS_TOKEN_ID)
    assert g.is_terminated()
    g.rollback(1)
    assert not g.is_terminated() and _allowed(g) == before
    g.rollback(len(ids) - 2)  # back into thinking, 2 think tokens accepted
    assert (g.think_len, g.answer_len) == (2, -1) and THINK_END_ID in _allowed(g)
    fresh = g.copy()
    assert (fresh.think_len, fresh.answer_len) == (0, -1)


def test_model_may_close_early_and_free_text_answer(tok, backend):
    specials = tok[1]
    closing = _closing(tok)
    bound = th.ThinkBound.make(40, th.answer_format(),
                               special_ids=specials, closing_ids=closing)
    lengths = []
    for seed in range(6):
        out = _walk(_grammar(backend, bound), seed, 80, close_p=0.1)
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= 40
        assert not set(out[think + 1:]) & (set(specials) - {EOS_TOKEN_ID})
        lengths.append(think)
    assert min(lengths) < 40 - len(closing), "an early </think> was never allowed"


def test_regex_and_ebnf_answers(tok, backend):
    tokenizer, specials = tok
    for answer, check in ((th.answer_format(regex=r"(yes|no)\.[0-9]"), r"^(yes|no)\.[0-9]$"),
                          (th.answer_format(ebnf='root ::= "A" [0-9] [0-9]'), r"^A[0-9][0-9]$")):
        bound = th.ThinkBound.make(5, answer, special_ids=specials)
        out = _walk(_grammar(backend, bound), 1, 40)
        think, ends = th.count_think_tokens(out)
        assert ends == 1 and think <= 5
        assert re.match(check, tokenizer.decode(out[think + 1:-1]))


def test_unbounded_think_still_closes_with_the_token_and_excludes_specials(tok, backend):
    specials = tok[1]
    bound = th.ThinkBound.make(None, th.answer_format(),
                               special_ids=specials)
    allowed = set(_allowed(_grammar(backend, bound)))
    assert THINK_END_ID in allowed and THINK_START_ID not in allowed and EOS_TOKEN_ID not in allowed
    assert len(allowed) == VOCAB - len(set(specials) | {THINK_START_ID})


def test_a_bad_answer_grammar_is_an_invalid_grammar_not_a_crash(tok, backend):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from sglang_dsv4.srt import thinking_grammar as tg

    bound = th.ThinkBound.make(4, {"type": "regex", "pattern": "(unclosed"}, special_ids=tok[1])
    g = tg.dispatch_structural_tag(XGrammarGrammarBackend.dispatch_structural_tag, backend, bound.to_key())
    assert isinstance(g, InvalidGrammarObject) and "think budget grammar" in g.error_message


def test_open_think_length_is_the_tokens_after_a_last_marker_that_opens():
    """Every prompt of up to 6 tokens over {other, <think>, </think>}, as a list and a tuple."""
    import itertools

    for n in range(7):
        for ids in itertools.product((5, THINK_START_ID, THINK_END_ID), repeat=n):
            marks = [i for i, t in enumerate(ids) if t in (THINK_START_ID, THINK_END_ID)]
            want = n - 1 - marks[-1] if marks and ids[marks[-1]] == THINK_START_ID else None
            assert th.open_think_length(list(ids)) == want and th.open_think_length(ids) == want, ids


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


def test_bound_forced_tokens_and_key_round_trip():
    b = th.ThinkBound.make(10, {"type": "regex", "pattern": "a"}, special_ids=[0, 1], closing_ids=[7, 8, 9])
    assert [b.forced(c) for c in range(11)] == [None] * 7 + [7, 8, 9, THINK_END_ID]
    assert th.ThinkBound.from_key(b.to_key(), [0, 1]) == b
    assert th.ThinkBound.from_key('{"type": "structural_tag"}', [0, 1]) is None
    assert len(b.to_key()) < 200  # the exclusions are not in the key (the scheduler knows them)
    assert THINK_END_ID not in b.think_exclude and EOS_TOKEN_ID in b.think_exclude
    assert EOS_TOKEN_ID not in b.answer_exclude and THINK_END_ID in b.answer_exclude
    unbounded = th.ThinkBound.make(None, {"type": "any_tokens"}, special_ids=[], closing_ids=[7])
    assert unbounded.forced(10 ** 9) is None


def test_enforceability_names_what_is_missing(tok):
    """A tokenizer without V4's think tokens (a real one, built in-process) and non-xgrammar
    backends cannot enforce a budget; the V4 tokenizer with xgrammar can."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sglang_dsv4.srt.thinking_http import enforceability_error

    word = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "think": 2}, unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=word, unk_token="<unk>")
    assert enforceability_error(None, tok[0]) is None and enforceability_error("xgrammar", tok[0]) is None
    assert "no DeepSeek-V4 think tokens" in enforceability_error("xgrammar", plain)
    for name in ("none", "llguidance", "outlines"):
        assert f"--grammar-backend {name}" in enforceability_error(name, tok[0])
    assert "--skip-tokenizer-init" in enforceability_error(None, None)


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
