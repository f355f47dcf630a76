"""Grammar-bounded Think mode: request fields -> an xgrammar structural tag that bounds thinking.

DeepSeek-V4 thinks between the special tokens ``<think>`` (128821) and ``</think>`` (128822).
With thinking on, the V4 chat template ends the prompt in ``<｜Assistant｜><think>``, so the
output starts inside the think section. A budget of N tokens becomes one structural tag that
xgrammar enforces token by token:

    think   := any token except the specials, at most N, then the </think> TOKEN
               (at exactly N - len(closing) tokens the closing text is forced, token by token)
    answer  := the request's own constraint (JSON schema / regex / EBNF) or free text

The ``</think>`` must be the token, not the string: the V4 specials decode to their literal text,
so a string match would let ordinary tokens spell it and never force the real one. This module
does not import SGLang (xgrammar only, to validate answer constraints): it is tested standalone
with xgrammar's GrammarMatcher; the SGLang glue lives in ``thinking_hooks``.

Request fields (validated here, errors name the field; see README "Thinking budget"):
``chat_template_kwargs.thinking`` (bool), ``thinking_budget`` / ``max_thinking_tokens`` /
``custom_params.thinking_budget`` (int >= 0), ``reasoning_effort`` (mapped by
``effort_budgets()``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from ..tokenizer_files import EOS_TOKEN_ID, THINK_END_ID, THINK_START_ID

THINK_START_TEXT, THINK_END_TEXT = "<think>", "</think>"

# Marker key inside our structural tags (xgrammar ignores unknown keys): the scheduler side
# recognises our grammars by it and reads the tokens to keep out of the answer.
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
    (a continued assistant message's reasoning) count against the budget.
    """
    for i in range(len(input_ids) - 1, -1, -1):
        if input_ids[i] == THINK_END_ID:
            return None
        if input_ids[i] == THINK_START_ID:
            return len(input_ids) - 1 - i
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
                  max_whitespace: Optional[int] = DEFAULT_JSON_MAX_WHITESPACE,
                  exclude_tokens: Sequence[int] = ()) -> dict:
    """The structural-tag format of the answer after ``</think>``, validated (errors name the field).

    Free text excludes ``exclude_tokens`` here; inside a JSON/regex/EBNF answer the scheduler-side
    grammar masks them (xgrammar lets special tokens into JSON strings).
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
    return {"type": "any_tokens", "exclude_tokens": list(exclude_tokens)}


def _check_json_schema(schema: Any) -> None:
    """Meta-validate a schema where jsonschema is installed (xgrammar ignores unknown keywords)."""
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validators.validator_for(schema).check_schema(schema)


def think_format(remaining: Optional[int], *, exclude_tokens: Sequence[int],
                 closing_ids: Sequence[int] = ()) -> dict:
    """The think section after ``<think>``: at most ``remaining`` tokens, then the ``</think>`` token.

    With a closing text that fits (remaining > its length), the model may close early on its
    own; at ``remaining - len(closing)`` tokens the closing tokens are forced, then ``</think>``,
    so the section is never longer than ``remaining``.
    """
    end = {"type": "token", "token": THINK_END_ID}
    if remaining is None:
        return {"type": "sequence", "elements": [{"type": "any_tokens", "exclude_tokens": list(exclude_tokens)}, end]}
    if remaining == 0:
        return end
    if not closing_ids or remaining <= len(closing_ids):
        return {"type": "sequence", "elements": [
            {"type": "any_tokens", "exclude_tokens": list(exclude_tokens), "max_tokens": remaining}, end]}
    free = remaining - len(closing_ids)
    one = {"type": "exclude_token", "exclude_tokens": list(exclude_tokens)}
    natural = {"type": "sequence", "elements": [{"type": "repeat", "min": 0, "max": free - 1, "content": one}, end]}
    forced = {"type": "sequence", "elements": [{"type": "repeat", "min": free, "max": free, "content": one},
                                               *({"type": "token", "token": t} for t in closing_ids), end]}
    return {"type": "or", "elements": [natural, forced]}


def build_structural_tag(remaining: Optional[int], answer: dict, *, special_ids: Iterable[int],
                         closing_ids: Sequence[int] = ()) -> dict:
    """The whole bound as one structural tag (think section, ``</think>``, answer).

    ``special_ids`` are the tokenizer's special tokens: none may appear while thinking, and in the
    answer only EOS (where the answer's grammar ends). The ids travel under ``TAG_KEY`` for the
    scheduler-side mask of the answer.
    """
    specials = sorted(set(special_ids) | {THINK_START_ID, THINK_END_ID, EOS_TOKEN_ID})
    return {"type": "structural_tag",
            "format": {"type": "sequence", "elements": [
                think_format(remaining, exclude_tokens=specials, closing_ids=closing_ids), answer]},
            TAG_KEY: {"think_end": THINK_END_ID, "answer_exclude": answer_exclusions(specials)}}


def answer_exclusions(special_ids: Iterable[int]) -> list[int]:
    """Tokens never allowed in the answer: every special token but EOS."""
    return sorted((set(special_ids) | {THINK_START_ID, THINK_END_ID}) - {EOS_TOKEN_ID})


def count_think_tokens(output_ids: Sequence[int], already: int = 0) -> tuple[int, int]:
    """(tokens thought before the first ``</think>`` including ``already``, number of ``</think>``)."""
    ends = [i for i, t in enumerate(output_ids) if t == THINK_END_ID]
    think = (ends[0] if ends else len(output_ids)) + already
    return think, len(ends)
