"""SGLang glue of the think budget (``thinking``): request fields in, a structural tag out.

Installed by the plugin (``plugin.register``); patches/thinking-budget.md lists each hook. When
the server runs with upstream's ``--enable-strict-thinking`` these hooks stand aside and
upstream's own ``custom_params.thinking_budget`` applies (the benchmark compares both).

- HTTP side: ``OpenAIServingChat.handle_request`` (chat fields -> ``chat_template_kwargs`` and
  ``custom_params.thinking_budget``, 400 on bad input before any streaming starts),
  ``generate_contract_error`` (400 for bad ``/generate`` budgets), ``GenerateReqInput
  .normalize_batch_and_arguments`` (native ``max_thinking_tokens`` without strict thinking),
  ``TokenizerManager._create_tokenized_object`` (prompt ids known: the structural tag).
- Scheduler side: ``XGrammarGrammarBackend.dispatch_structural_tag`` wraps our grammars so the
  answer never contains special tokens; ``XGrammarGrammarBackend.apply_vocab_mask`` gains the
  CPU branch it lacks (upstream strict thinking crashed the CPU scheduler without it).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any, Optional

import torch

from .thinking import (
    DEFAULT_JSON_MAX_WHITESPACE,
    TAG_KEY,
    ThinkingRequestError,
    ThinkingSettings,
    answer_exclusions,
    answer_format,
    build_structural_tag,
    effective_budget,
    not_inside_think_error,
    open_think_length,
    parse_budget,
    resolve_chat_thinking,
    text_opens_think,
)

logger = logging.getLogger(__name__)

JSON_MAX_WHITESPACE_DISABLED = 1  # xgrammar needs > 0 in a structural tag


@lru_cache(maxsize=1)
def settings() -> ThinkingSettings:
    """Server-side settings, read once per process from the environment."""
    return ThinkingSettings.from_env()


def _strict_thinking(server_args: Any = None) -> bool:
    """Upstream's strict thinking owns budgets on this server."""
    if server_args is not None:
        return bool(getattr(server_args, "enable_strict_thinking", False))
    from sglang.srt.runtime_context import get_serving

    return bool(getattr(get_serving(), "enable_strict_thinking", False))


# ---- HTTP process: /v1/chat/completions ------------------------------------------------------

async def chat_handle_request(original, serving, request, raw_request, *args, **kwargs):
    """Settle thinking and its budget from the chat request; HTTP 400 on invalid fields."""
    if _strict_thinking(serving.tokenizer_manager.server_args):
        return await original(serving, request, raw_request, *args, **kwargs)
    try:
        body = await raw_request.json() if raw_request is not None else {}
        if not isinstance(body, dict):
            body = {}
        ctk = dict(request.chat_template_kwargs or {})
        custom = dict(request.custom_params or {})
        effort = request.reasoning_effort or ctk.get("reasoning_effort")
        spec = resolve_chat_thinking(
            thinking=ctk.get("thinking"),
            budgets={"thinking_budget": body.get("thinking_budget"),
                     "max_thinking_tokens": body.get("max_thinking_tokens"),
                     "custom_params.thinking_budget": custom.get("thinking_budget")},
            reasoning_effort=effort, settings=settings())
        if spec.thinking:
            _check_response_format(request)
            ctk["thinking"] = True
            request.chat_template_kwargs = ctk
            custom.pop("thinking_budget", None)
            custom["dsv4_thinking"] = {"budget": spec.budget}
            request.custom_params = custom
    except ThinkingRequestError as e:
        return serving.create_error_response(message=str(e), err_type="BadRequest", status_code=400)
    return await original(serving, request, raw_request, *args, **kwargs)


def _check_response_format(request) -> None:
    """Compile-check the answer constraint now, so a bad one is a 400 before streaming starts."""
    rf = getattr(request, "response_format", None)
    if rf is None or getattr(rf, "type", None) != "json_schema" or rf.json_schema is None:
        return
    schema = getattr(rf.json_schema, "schema_", None)
    if schema is None:
        schema = getattr(rf.json_schema, "schema", None)
    if schema is not None:
        answer_format(json_schema=json.dumps(schema))


# ---- HTTP process: /generate --------------------------------------------------------------

def _budget_fields(body: dict) -> list[tuple[str, Any]]:
    fields = [("max_thinking_tokens", body.get("max_thinking_tokens"))]
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and isinstance(p.get("custom_params"), dict):
            fields.append(("sampling_params.custom_params.thinking_budget", p["custom_params"].get("thinking_budget")))
    return fields


def generate_contract_error(result: Optional[str], body: Any, *args, **kwargs) -> Optional[str]:
    """After upstream's /generate contract check: invalid budgets get a 400 naming the field
    (upstream's own check says only "invalid value: integer `-3`, expected u64")."""
    if not isinstance(body, dict) or _strict_thinking():
        return result
    try:
        budgets = [parse_budget(value, field) for field, value in _budget_fields(body) if value is not None]
        if any(budgets):  # checked here too so that a streamed request gets its 400 before the stream
            _check_prompt_opens_think(body, max(budgets))
    except ThinkingRequestError as e:
        return str(e)
    return result


def _check_prompt_opens_think(body: dict, budget: int) -> None:
    """A budget needs a prompt that ends inside a think section (ids or text; batches each)."""
    ids, text = body.get("input_ids"), body.get("text")
    if isinstance(ids, list) and ids:
        for one in ids if isinstance(ids[0], list) else [ids]:
            if all(isinstance(t, int) for t in one) and open_think_length(one) is None:
                raise not_inside_think_error(budget)
    elif text is not None:
        for one in text if isinstance(text, list) else [text]:
            if isinstance(one, str) and not text_opens_think(one):
                raise not_inside_think_error(budget)


def after_normalize(result, obj, *args, **kwargs):
    """Native ``max_thinking_tokens`` is upstream's strict-thinking field: carry it to ours."""
    budget = getattr(obj, "max_thinking_tokens", None)
    if budget is None or _strict_thinking():
        return result
    params = obj.sampling_params
    items = params if isinstance(params, list) else [params]
    moved = []
    for p in items:
        p = dict(p or {})
        custom = dict(p.get("custom_params") or {})
        custom["thinking_budget"] = budget
        p["custom_params"] = custom
        moved.append(p)
    obj.sampling_params = moved if isinstance(params, list) else moved[0]
    obj.max_thinking_tokens = None
    return result


def create_tokenized_object(original, manager, obj, input_text, input_ids, *args, **kwargs):
    """The prompt's ids are known: turn the request's thinking fields into a structural tag."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if (isinstance(obj, GenerateReqInput) and input_ids is not None
            and not _strict_thinking(manager.server_args)):
        new_params = thinking_sampling_params(dict(obj.sampling_params or {}), list(input_ids),
                                              manager.tokenizer, manager.server_args)
        if new_params is not None:
            obj.sampling_params = new_params
    return original(manager, obj, input_text, input_ids, *args, **kwargs)


def thinking_sampling_params(params: dict, input_ids: list[int], tokenizer, server_args) -> Optional[dict]:
    """Sampling params with the think bound as a structural tag, or None when not ours.

    Ours: a budget was given (chat settles it into ``custom_params.dsv4_thinking``; /generate
    uses ``custom_params.thinking_budget``), or the prompt is inside thinking and the answer is
    constrained (the constraint must wait for ``</think>``).
    """
    custom = dict(params.get("custom_params") or {})
    chat = custom.pop("dsv4_thinking", None)
    if chat is not None:
        budget = chat.get("budget")
        explicit = budget is not None
    else:
        raw = custom.get("thinking_budget")
        budget = None if raw is None else parse_budget(raw, "custom_params.thinking_budget")
        explicit = raw is not None
    already = open_think_length(input_ids)
    constrained = any(params.get(k) is not None for k in ("json_schema", "regex", "ebnf"))
    if already is None:
        if explicit and budget:
            raise not_inside_think_error(budget)
        return _without_marker(params, custom, chat)
    if not explicit:
        budget = settings().default_budget
    if budget is None and not constrained:
        return _without_marker(params, custom, chat)  # unbounded, free answer: nothing to enforce
    if params.get("structural_tag") is not None:
        raise ThinkingRequestError("a thinking budget cannot be combined with a structural_tag constraint")
    special = special_token_ids(tokenizer)
    no_ws = bool(getattr(server_args, "constrained_json_disable_any_whitespace", False))
    answer = answer_format(json_schema=params.pop("json_schema", None), regex=params.pop("regex", None),
                           ebnf=params.pop("ebnf", None),
                           max_whitespace=JSON_MAX_WHITESPACE_DISABLED if no_ws else DEFAULT_JSON_MAX_WHITESPACE,
                           exclude_tokens=answer_exclusions(special))
    remaining = effective_budget(budget, already, params.get("max_new_tokens"), settings().answer_reserve)
    tag = build_structural_tag(remaining, answer, special_ids=special,
                               closing_ids=closing_token_ids(tokenizer, settings().closing_text))
    params["structural_tag"] = json.dumps(tag)
    from sglang.srt.sampling.sampling_params import set_request_reasoning_in_grammar

    params["custom_params"] = custom
    # With --reasoning-parser, SGLang defers a grammar to </think>; ours covers the think too.
    set_request_reasoning_in_grammar(params, True)
    return params


def _without_marker(params: dict, custom: dict, chat: Optional[dict]) -> Optional[dict]:
    if chat is None:
        return None
    params["custom_params"] = custom or None
    return params


def special_token_ids(tokenizer) -> list[int]:
    """Every special token of the tokenizer (V4: BOS, EOS, the role and think tokens, reserved)."""
    key = id(tokenizer)
    if key not in _SPECIAL_CACHE:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        _SPECIAL_CACHE[key] = sorted({i for i, t in decoder.items() if getattr(t, "special", False)}
                                     | set(getattr(tokenizer, "all_special_ids", []) or []))
    return _SPECIAL_CACHE[key]


_SPECIAL_CACHE: dict[int, list[int]] = {}


def closing_token_ids(tokenizer, text: str) -> list[int]:
    """The closing text's own tokenization (forced token by token, so its length is exact)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


# ---- scheduler process ---------------------------------------------------------------------

def wrap_structural_tag_grammar(result, backend, key_string: str, *args, **kwargs):
    """After ``dispatch_structural_tag``: our tags get the answer-side special-token mask."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    if isinstance(result, XGrammarGrammar) and TAG_KEY in key_string:
        meta = json.loads(key_string).get(TAG_KEY) or {}
        return ThinkBudgetGrammar.wrap(result, int(meta["think_end"]), meta.get("answer_exclude") or [])
    return result


def _answer_mask_row(vocab_size: int, excluded: tuple[int, ...]) -> torch.Tensor:
    """A bitmask row (xgrammar layout, int32 words) with the excluded tokens' bits cleared."""
    import xgrammar as xgr

    row = torch.full((xgr.get_bitmask_shape(1, vocab_size)[1],), -1, dtype=torch.int32)
    for t in excluded:
        row[t // 32] &= ~(1 << (t % 32))
    return row


_ROWS: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def _make_think_budget_grammar_class():
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    class _ThinkBudgetGrammar(XGrammarGrammar):
        """An XGrammar grammar of our structural tag that also masks special tokens in the answer
        (xgrammar admits them inside JSON strings, where a decoded ``</think>`` would confuse the
        reasoning parser)."""

        @classmethod
        def wrap(cls, base: XGrammarGrammar, think_end: int, excluded: list[int]) -> "_ThinkBudgetGrammar":
            obj = cls(base.matcher, base.vocab_size, base.ctx, base.override_stop_tokens,
                      base.key_string, base.grammar_stats)
            obj.think_end = think_end
            obj.excluded = tuple(excluded)
            key = (base.vocab_size, obj.excluded)
            if key not in _ROWS:
                _ROWS[key] = _answer_mask_row(base.vocab_size, key[1])
            obj.answer_row = _ROWS[key]
            obj.answer_from: Optional[int] = None  # accepted-token count where the answer starts
            return obj

        def accept_token(self, token: int) -> None:
            super().accept_token(token)
            if self.answer_from is None and token == self.think_end:
                self.answer_from = len(self.accepted_tokens)

        def rollback(self, k: int) -> None:
            super().rollback(k)
            if self.answer_from is not None and len(self.accepted_tokens) < self.answer_from:
                self.answer_from = None

        def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
            super().fill_vocab_mask(vocab_mask, idx)
            if self.answer_from is not None:
                vocab_mask[idx] &= self.answer_row.to(vocab_mask.device)

        def copy(self) -> "_ThinkBudgetGrammar":
            return type(self).wrap(super().copy(), self.think_end, list(self.excluded))

    return _ThinkBudgetGrammar


class _Lazy:
    """Builds the grammar class on first use (sglang's xgrammar backend imports triton ops)."""

    _cls = None

    def wrap(self, base, think_end: int, excluded: list[int]):
        if _Lazy._cls is None:
            _Lazy._cls = _make_think_budget_grammar_class()
        return _Lazy._cls.wrap(base, think_end, excluded)


ThinkBudgetGrammar = _Lazy()


def apply_vocab_mask_cpu(original, logits: torch.Tensor, vocab_mask: torch.Tensor, *args, **kwargs) -> None:
    """``XGrammarGrammarBackend.apply_vocab_mask`` has no CPU branch (0.5.23): add xgrammar's."""
    if logits.device.type == "cpu":
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device), backend="cpu")
        return None
    return original(logits, vocab_mask, *args, **kwargs)


def register(hook_registry, hook_type) -> None:
    """Install the think-budget hooks (called from ``plugin.register``; see patches/thinking-budget.md)."""
    for target, hook, kind in (
        ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat.handle_request",
         chat_handle_request, hook_type.AROUND),
        ("sglang.srt.entrypoints.api_contract.generate_contract_error", generate_contract_error, hook_type.AFTER),
        ("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
         after_normalize, hook_type.AFTER),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
         create_tokenized_object, hook_type.AROUND),
        ("sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_structural_tag",
         wrap_structural_tag_grammar, hook_type.AFTER),
        ("sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask",
         apply_vocab_mask_cpu, hook_type.AROUND),
    ):
        hook_registry.register(target, hook, kind)
