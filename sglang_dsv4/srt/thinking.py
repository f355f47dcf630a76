"""Grammar-bounded Think mode: request fields -> a ``ThinkBound`` the scheduler's grammar enforces.

DeepSeek-V4 thinks between the special tokens ``<think>`` (128821) and ``</think>`` (128822).
With thinking on, the V4 chat template ends the prompt in ``<｜Assistant｜><think>``, so the
output starts inside the think section. A budget of N tokens becomes a bound that our own
grammar object (``thinking_grammar``) enforces token by token:

    think   := any token except the specials, at most N, then the </think> TOKEN
               (at exactly N - len(closing) tokens the closing text is forced, token by token;
               a budget too short for the closing text forces </think> alone)
    answer  := the request's own constraint (JSON schema / regex / EBNF) or free text

The think section is a counter and a precomputed mask, so its per-token cost does not depend on
N (a grammar that counts N tokens in its states costs more the larger N is; see
benchmarks/results/thinking_budget_cpu.md). The ``</think>`` must be the token, not the string:
the V4 specials decode to their literal text, so a string match would let ordinary tokens spell
it and never force the real one. This module does not import SGLang (xgrammar only, to validate
answer constraints); the HTTP-side glue is ``thinking_http``, the scheduler side
``thinking_grammar``.

Request fields (validated here, errors name the field; see README "Thinking budget"):
``chat_template_kwargs.thinking`` (bool), ``thinking_budget`` / ``max_thinking_tokens`` /
``custom_params.thinking_budget`` (int >= 0), ``reasoning_effort`` (mapped by
``ThinkingSettings.effort_budgets``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from ..tokenizer_files import EOS_TOKEN_ID, THINK_END_ID, THINK_START_ID

THINK_START_TEXT, THINK_END_TEXT = "<think>", "</think>"

# Marker key of our grammar keys (they travel as sampling_params.structural_tag, the one grammar
# field that carries arbitrary JSON to the scheduler, which recognises ours by this key).
TAG_KEY = "dsv4_thinking"
# The budget field names a request may use (all mean the same; giving two that differ is an error).
BUDGET_FIELDS = ("thinking_budget", "max_thinking_tokens", "custom_params.thinking_budget")

# reasoning_effort -> thinking budget in tokens (None: unbounded). Server-side defaults; override
# with SGLANG_DSV4_THINKING_EFFORT_BUDGETS='{"low": 256, ...}'.
DEFAULT_EFFORT_BUDGETS: dict[str, Optional[int]] = {
    "none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192, "xhigh": 32768, "max": None,
}
# Forced (as its exact tokens) when the budget runs out, before </think>; counts inside the budget.
DEFAULT_CLOSING_TEXT = "\n\nTime to answer.\n"
# When a budget would leave the answer less than this share of max_new_tokens, thinking is cut
# earlier: a bound that ends in a length cut-off inside the think section gives no answer at all.
DEFAULT_ANSWER_RESERVE = 0.5
# JSON answers: at most this many consecutive whitespace characters (unbounded whitespace lets
# weak or random models wander); 1 when the server runs --constrained-json-disable-any-whitespace.
DEFAULT_JSON_MAX_WHITESPACE = 16


class ThinkingRequestError(ValueError):
    """A request's thinking fields are invalid (served as HTTP 400; the message names the field)."""


@dataclass(frozen=True)
class ThinkingSettings:
    """Server-side settings (environment variables of the serving process)."""

    effort_budgets: dict[str, Optional[int]]
    closing_text: str
    answer_reserve: float
    default_budget: Optional[int]

    @classmethod
    def from_env(cls, env: Optional[dict[str, str]] = None) -> "ThinkingSettings":
        """Read ``SGLANG_DSV4_THINKING_*`` (see README); invalid values raise ValueError at startup."""
        env = os.environ if env is None else env
        budgets = dict(DEFAULT_EFFORT_BUDGETS)
        raw = env.get("SGLANG_DSV4_THINKING_EFFORT_BUDGETS")
        if raw:
            for effort, value in json.loads(raw).items():
                budgets[effort] = None if value is None else parse_budget(value, f"effort budget {effort!r}")
        default = env.get("SGLANG_DSV4_DEFAULT_THINKING_BUDGET")
        reserve = float(env.get("SGLANG_DSV4_THINKING_ANSWER_RESERVE", DEFAULT_ANSWER_RESERVE))
        if not 0.0 <= reserve < 1.0:
            raise ValueError("SGLANG_DSV4_THINKING_ANSWER_RESERVE must be in [0, 1)")
        return cls(effort_budgets=budgets,
                   closing_text=env.get("SGLANG_DSV4_THINKING_CLOSING_TEXT", DEFAULT_CLOSING_TEXT),
                   answer_reserve=reserve,
                   default_budget=None if default in (None, "") else parse_budget(int(default), "default budget"))


def parse_budget(value: Any, field: str) -> int:
    """A budget must be a JSON integer >= 0 (bools and floats are rejected, 7.0 included)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ThinkingRequestError(f"{field} must be a non-negative integer number of tokens, got {value!r}")
    if value < 0:
        raise ThinkingRequestError(f"{field} must be >= 0 (0 means no thinking), got {value}")
    return value


def request_budget(values: dict[str, Any]) -> Optional[int]:
    """The one budget among the fields given (``values`` maps field name -> value or absent)."""
    given = {name: parse_budget(v, name) for name, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise ThinkingRequestError(f"conflicting thinking budgets: {given}; give one of {', '.join(BUDGET_FIELDS)}")
    return next(iter(given.values()), None)


@dataclass(frozen=True)
class ChatThinking:
    """What a chat request asked for: thinking on/off (None: not said) and the budget (None: unbounded)."""

    thinking: Optional[bool]
    budget: Optional[int]


def resolve_chat_thinking(*, thinking: Any, budgets: dict[str, Any], reasoning_effort: Optional[str],
                          settings: ThinkingSettings) -> ChatThinking:
    """Validate a chat request's thinking fields and settle its budget.

    ``thinking`` is ``chat_template_kwargs.thinking`` (the V4 template's flag; V4's default is off).
    An explicit budget turns thinking on when the flag is absent; a positive budget with
    ``thinking: false`` is an error. ``reasoning_effort`` gives the budget when none is explicit.
    """
    if thinking is not None and not isinstance(thinking, bool):
        raise ThinkingRequestError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r}")
    budget = request_budget(budgets)
    if budget is not None:
        if thinking is False and budget > 0:
            field = next(name for name, v in budgets.items() if v is not None)
            raise ThinkingRequestError(
                f"{field}={budget} needs thinking on, but chat_template_kwargs.thinking is false; "
                "drop the budget or set thinking to true")
        return ChatThinking(thinking=True if thinking is None else thinking, budget=budget)
    if not thinking:
        return ChatThinking(thinking=thinking, budget=None)
    if reasoning_effort is not None:
        if reasoning_effort not in settings.effort_budgets:
            raise ThinkingRequestError(f"reasoning_effort must be one of {sorted(settings.effort_budgets)}, "
                                       f"got {reasoning_effort!r}")
        return ChatThinking(thinking=True, budget=settings.effort_budgets[reasoning_effort])
    return ChatThinking(thinking=True, budget=settings.default_budget)


def open_think_length(input_ids: Sequence[int]) -> Optional[int]:
    """Tokens already thought when the prompt ends inside a think section, else None.

    The prompt is inside thinking when its last think marker is ``<think>``; the tokens after it
    (a continued assistant message's reasoning) count against the budget. Every /generate
    request asks this of its prompt: the two reversed searches run in C (a 64K-token prompt
    without markers: ~0.5 ms, against ~2 ms for a Python loop over it).
    """
    rev = list(reversed(input_ids))
    since_start = _first_index(rev, THINK_START_ID)
    if since_start is None:
        return None
    since_end = _first_index(rev, THINK_END_ID)
    return since_start if since_end is None or since_end > since_start else None


def _first_index(seq: Sequence[int], value: int) -> Optional[int]:
    try:
        return seq.index(value)
    except ValueError:
        return None


def text_opens_think(text: str) -> bool:
    """Whether a text prompt ends inside a think section (its last think marker is ``<think>``;
    SGLang tokenizes the markers in a prompt text as the special tokens)."""
    return text.rfind(THINK_START_TEXT) > text.rfind(THINK_END_TEXT)


def not_inside_think_error(budget: int) -> ThinkingRequestError:
    return ThinkingRequestError(
        f"thinking budget {budget} given, but the prompt does not end inside a think section "
        "(its last think token must be <think>); turn thinking on "
        "(chat_template_kwargs.thinking) or end the prompt in <think>")


def effective_budget(budget: Optional[int], already: int, max_new_tokens: Optional[int],
                     answer_reserve: float) -> Optional[int]:
    """Tokens the output may still think (None: unbounded).

    The budget counts the prompt's open reasoning too. With max_new_tokens, thinking stops
    early enough that ``</think>`` and ``answer_reserve * max_new_tokens`` answer tokens still fit.
    """
    remaining = None if budget is None else max(0, budget - already)
    if max_new_tokens is not None:
        room = max(0, max_new_tokens - 1 - math.ceil(answer_reserve * max_new_tokens))
        remaining = room if remaining is None else min(remaining, room)
    return remaining


def answer_format(*, json_schema: Optional[str] = None, regex: Optional[str] = None, ebnf: Optional[str] = None,
                  max_whitespace: Optional[int] = DEFAULT_JSON_MAX_WHITESPACE) -> dict:
    """The answer after ``</think>`` as a structural-tag-style format dict, validated (errors
    name the field); ``{"type": "any_tokens"}`` is free text. Whatever the answer, the scheduler
    side keeps ``ThinkBound.answer_exclude`` (every special but EOS) out of it.
    """
    import xgrammar as xgr

    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf)) if v is not None]
    if len(given) > 1:
        raise ThinkingRequestError(f"only one answer constraint is allowed, got {given}")
    try:
        if json_schema is not None:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")
            _check_json_schema(schema)
            xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=max_whitespace)
            return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": max_whitespace}
        if regex is not None:
            xgr.Grammar.from_regex(regex)
            return {"type": "regex", "pattern": regex}
        if ebnf is not None:
            xgr.Grammar.from_ebnf(ebnf)
            return {"type": "grammar", "grammar": ebnf}
    except ThinkingRequestError:
        raise
    except Exception as e:  # json, jsonschema and xgrammar parse errors alike
        field = {"json_schema": "response_format.json_schema", "regex": "regex", "ebnf": "ebnf"}[given[0]]
        raise ThinkingRequestError(f"invalid {field}: {e}") from None
    return {"type": "any_tokens"}


def _check_json_schema(schema: Any) -> None:
    """Meta-validate a schema where jsonschema is installed (xgrammar ignores unknown keywords)."""
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validators.validator_for(schema).check_schema(schema)


@dataclass(frozen=True)
class ThinkBound:
    """What the scheduler-side grammar enforces for one request (``thinking_grammar``).

    ``remaining`` think tokens may still be spent (None: unbounded); when they run out,
    ``closing_ids`` are forced token by token, then the ``</think>`` token, all within
    ``remaining``. A closing text that does not fit (``remaining <= len(closing)``) is dropped
    and ``</think>`` alone is forced at ``remaining``: a cut-off closing text would be noise.
    ``think_exclude`` never appears while thinking, ``answer_exclude`` never in the answer;
    ``answer`` is an ``answer_format()`` dict (JSON schema / regex / EBNF / free text).
    """

    remaining: Optional[int]
    closing_ids: tuple[int, ...]
    think_exclude: tuple[int, ...]
    answer_exclude: tuple[int, ...]
    answer: dict

    @classmethod
    def make(cls, remaining: Optional[int], answer: dict, *, special_ids: Iterable[int],
             closing_ids: Sequence[int] = ()) -> "ThinkBound":
        """The bound for a budget; ``special_ids`` are the tokenizer's special tokens."""
        specials = set(special_ids) | {THINK_START_ID, THINK_END_ID, EOS_TOKEN_ID}
        fits = remaining is None or remaining > len(closing_ids)
        return cls(remaining=remaining, closing_ids=tuple(closing_ids) if fits else (),
                   think_exclude=tuple(sorted(specials - {THINK_END_ID})),
                   answer_exclude=tuple(answer_exclusions(specials)), answer=answer)

    def forced(self, count: int) -> Optional[int]:
        """The only token allowed after ``count`` think tokens, or None while thinking is free
        (any token but ``think_exclude``, ``</think>`` included)."""
        if self.remaining is None:
            return None
        free = self.remaining - len(self.closing_ids)
        if count < free:
            return None
        i = count - free
        return self.closing_ids[i] if i < len(self.closing_ids) else THINK_END_ID

    def to_key(self) -> str:
        """The grammar key (sent as ``sampling_params.structural_tag``; ``TAG_KEY`` marks it ours).
        The exclusions stay out of it: the scheduler derives them from its own tokenizer, so the
        key stays small (SGLang parses and hashes it per request)."""
        return json.dumps({TAG_KEY: {"remaining": self.remaining, "closing": list(self.closing_ids),
                                     "answer": self.answer}})

    @classmethod
    def from_key(cls, key: str, special_ids: Iterable[int]) -> Optional["ThinkBound"]:
        """The bound in a grammar key (None when the key is not ours)."""
        if TAG_KEY not in key:
            return None
        meta = json.loads(key).get(TAG_KEY)
        if not isinstance(meta, dict):
            return None
        return cls.make(meta["remaining"], meta["answer"], special_ids=special_ids, closing_ids=meta["closing"])


def answer_exclusions(special_ids: Iterable[int]) -> list[int]:
    """Tokens never allowed in the answer: every special token but EOS."""
    return sorted((set(special_ids) | {THINK_START_ID, THINK_END_ID}) - {EOS_TOKEN_ID})


def special_token_ids(tokenizer) -> list[int]:
    """Every special token of a HF tokenizer (V4: BOS, EOS, the role tokens, reserved ones; the
    think tokens are added but not special, ``ThinkBound`` adds them)."""
    key = id(tokenizer)
    if key not in _SPECIAL_CACHE:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        _SPECIAL_CACHE[key] = sorted({i for i, t in decoder.items() if getattr(t, "special", False)}
                                     | set(getattr(tokenizer, "all_special_ids", []) or []))
    return _SPECIAL_CACHE[key]


_SPECIAL_CACHE: dict[int, list[int]] = {}  # per tokenizer object: 1.2k ids, read per request


def count_think_tokens(output_ids: Sequence[int], already: int = 0) -> tuple[int, int]:
    """(tokens thought before the first ``</think>`` including ``already``, number of ``</think>``)."""
    ends = [i for i, t in enumerate(output_ids) if t == THINK_END_ID]
    think = (ends[0] if ends else len(output_ids)) + already
    return think, len(ends)
