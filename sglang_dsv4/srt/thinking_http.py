"""HTTP side of the think budget (tokenizer-manager process): request fields in, a grammar key out.

- ``OpenAIServingChat.handle_request``: chat fields -> ``chat_template_kwargs`` and
  ``custom_params.dsv4_thinking``; 400 on bad input before any streaming starts.
- ``generate_contract_error``: 400 for bad ``/generate`` budgets (streamed ones included).
- ``GenerateReqInput.normalize_batch_and_arguments``: native ``max_thinking_tokens`` without
  upstream's strict thinking.
- ``TokenizerManager._create_tokenized_object``: with the prompt ids known, the request's bound
  (``ThinkBound``) becomes its grammar key (``sampling_params.structural_tag``), which the
  scheduler side (``thinking_grammar``) turns into our grammar object.

A budget this server cannot enforce (no xgrammar backend, a tokenizer without V4's ``</think>``
token) is a 400 that says why, never a silently ignored budget. With upstream's
``--enable-strict-thinking`` every hook here stands aside (upstream's mechanism applies).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Optional, Sequence

from ..tokenizer_files import THINK_END_ID, THINK_START_ID
from .thinking import (
    DEFAULT_JSON_MAX_WHITESPACE,
    ThinkBound,
    ThinkingRequestError,
    ThinkingSettings,
    answer_format,
    effective_budget,
    not_inside_think_error,
    open_think_length,
    parse_budget,
    resolve_chat_thinking,
    special_token_ids,
    text_opens_think,
)

JSON_MAX_WHITESPACE_DISABLED = 1  # --constrained-json-disable-any-whitespace: at most one


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


# ---- can this server enforce a budget? -----------------------------------------------------

def enforceability_error(grammar_backend: Optional[str], tokenizer: Any) -> Optional[str]:
    """Why this server cannot enforce a thinking budget, or None when it can.

    ``grammar_backend`` is the server's ``--grammar-backend`` (None: SGLang's default, xgrammar);
    ``tokenizer`` the served tokenizer (None: ``--skip-tokenizer-init``).
    """
    if grammar_backend not in (None, "xgrammar"):
        return (f"a thinking budget is enforced by the grammar backend, but this server runs "
                f"--grammar-backend {grammar_backend}; serve with --grammar-backend xgrammar")
    if tokenizer is None:
        return "a thinking budget needs the server's tokenizer, but it runs --skip-tokenizer-init"
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in ("<think>", "</think>")}
    if ids != {"<think>": THINK_START_ID, "</think>": THINK_END_ID}:
        return (f"this model's tokenizer has no DeepSeek-V4 think tokens (<think> {THINK_START_ID}, "
                f"</think> {THINK_END_ID}; found {ids}), so a thinking budget cannot be enforced")
    return None


def _server_grammar_backend(server_args: Any) -> Optional[str]:
    return getattr(server_args, "grammar_backend", None)


def _check_enforceable(server_args: Any, tokenizer: Any, field: str) -> None:
    error = enforceability_error(_server_grammar_backend(server_args), tokenizer)
    if error is not None:
        raise ThinkingRequestError(f"{field}: {error}")


def _tokenizer_manager():
    """The HTTP process's tokenizer manager (None before the server is up)."""
    from sglang.srt.entrypoints import http_server

    state = getattr(http_server, "_global_state", None)  # set once by launch_server
    return getattr(state, "tokenizer_manager", None)


# ---- /v1/chat/completions ------------------------------------------------------------------

async def chat_handle_request(original, serving, request, raw_request, *args, **kwargs):
    """Settle thinking and its budget from the chat request; HTTP 400 on invalid fields."""
    manager = serving.tokenizer_manager
    if _strict_thinking(manager.server_args):
        return await original(serving, request, raw_request, *args, **kwargs)
    try:
        body = await raw_request.json() if raw_request is not None else {}
        if not isinstance(body, dict):
            body = {}
        ctk = dict(request.chat_template_kwargs or {})
        custom = dict(request.custom_params or {})
        effort = request.reasoning_effort or ctk.get("reasoning_effort")
        budgets = {"thinking_budget": body.get("thinking_budget"),
                   "max_thinking_tokens": body.get("max_thinking_tokens"),
                   "custom_params.thinking_budget": custom.get("thinking_budget")}
        spec = resolve_chat_thinking(thinking=ctk.get("thinking"), budgets=budgets,
                                     reasoning_effort=effort, settings=settings())
        if spec.thinking:
            if spec.budget is not None:
                field = next((name for name, v in budgets.items() if v is not None), "reasoning_effort")
                _check_enforceable(manager.server_args, manager.tokenizer, field)
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


# ---- /generate -----------------------------------------------------------------------------

def _budget_fields(body: dict) -> list[tuple[str, Any]]:
    fields = [("max_thinking_tokens", body.get("max_thinking_tokens"))]
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and isinstance(p.get("custom_params"), dict):
            fields.append(("sampling_params.custom_params.thinking_budget", p["custom_params"].get("thinking_budget")))
    return fields


def generate_contract_error(result: Optional[str], body: Any, *args, **kwargs) -> Optional[str]:
    """After upstream's /generate contract check: invalid or unenforceable budgets get a 400 naming
    the field (upstream's own check says only "invalid value: integer `-3`, expected u64")."""
    if not isinstance(body, dict) or _strict_thinking():
        return result
    try:
        given = [(field, parse_budget(value, field)) for field, value in _budget_fields(body) if value is not None]
        manager = _tokenizer_manager()
        if given and manager is not None:
            _check_enforceable(manager.server_args, manager.tokenizer, given[0][0])
        budgets = [b for _, b in given]
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
    """The prompt's ids are known: turn the request's thinking fields into our grammar key."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if (isinstance(obj, GenerateReqInput) and input_ids is not None
            and not _strict_thinking(manager.server_args)):
        new_params = thinking_sampling_params(dict(obj.sampling_params or {}), input_ids,
                                              manager.tokenizer, manager.server_args)
        if new_params is not None:
            obj.sampling_params = new_params
    return original(manager, obj, input_text, input_ids, *args, **kwargs)


def thinking_sampling_params(params: dict, input_ids: Sequence[int], tokenizer, server_args) -> Optional[dict]:
    """Sampling params with the think bound as our grammar key, or None when not ours.

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
    if enforceability_error(_server_grammar_backend(server_args), tokenizer) is not None:
        if budget is not None:
            _check_enforceable(server_args, tokenizer, "thinking budget")
        return _without_marker(params, custom, chat)  # not V4's think tokens: leave it to SGLang
    if params.get("structural_tag") is not None:
        raise ThinkingRequestError("a thinking budget cannot be combined with a structural_tag constraint")
    special = special_token_ids(tokenizer)
    no_ws = bool(getattr(server_args, "constrained_json_disable_any_whitespace", False))
    answer = answer_format(json_schema=params.pop("json_schema", None), regex=params.pop("regex", None),
                           ebnf=params.pop("ebnf", None),
                           max_whitespace=JSON_MAX_WHITESPACE_DISABLED if no_ws else DEFAULT_JSON_MAX_WHITESPACE)
    remaining = effective_budget(budget, already, params.get("max_new_tokens"), settings().answer_reserve)
    bound = ThinkBound.make(remaining, answer, special_ids=special,
                            closing_ids=closing_token_ids(tokenizer, settings().closing_text))
    params["structural_tag"] = bound.to_key()
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


def closing_token_ids(tokenizer, text: str) -> list[int]:
    """The closing text's own tokenization (forced token by token, so its length is exact)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
