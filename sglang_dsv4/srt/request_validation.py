"""Request data our model cannot take is refused at the HTTP edge (400), never in the scheduler.

SGLang 0.5.23 checks a prompt's length, ``logit_bias`` keys and ``token_ids_logprob`` against the
vocabulary, but not the prompt's own token ids, nor that each prompt of a batch is non-empty, nor
``top_logprobs_num`` and a ``logprob_start_len`` below -1. What it lets through reaches the
scheduler process, where an exception stops the whole server: an id >= the vocabulary size fails
the embedding gather in ``core.model.V4Model.forward``, an empty prompt its shape check,
``top_logprobs_num`` above the vocabulary size ``topk`` in SGLang's sampler, ``logprob_start_len``
< -1 an assertion in SGLang's logprob bookkeeping; a negative id silently embeds row
``vocab + id``. Installed by the plugin (``plugin.register``); patches/request-validation.md.

- ``TokenizerManager._validate_one_request`` (AROUND): the one function every generate path calls
  with a request's final prompt ids (``/generate`` single and batched, ``/v1/completions`` with
  text or token prompts, chat, the offline engine), in the HTTP process, before the request is
  sent. Its ValueError is what SGLang already turns into a 400 (e.g. a prompt over the context
  length).
- ``api_contract.generate_contract_error`` (AFTER): the ``/generate`` body gate, which runs before
  a streamed response starts: without it a streamed ``/generate`` with a bad id would get HTTP
  200 and an error event. It sees the whole batch, so it names the prompt's place in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

ARCH = "DeepseekV4ForCausalLM"


def prompt_ids_error(input_ids: Sequence[int], vocab_size: int, field: str = "input_ids") -> Optional[str]:
    """Why ``input_ids`` cannot be a prompt of a ``vocab_size``-token model, or None if it can.

    The message names ``field``, the first bad id, its index and the vocabulary size.
    """
    if len(input_ids) == 0:
        return f"{field} is empty: a prompt needs at least one token"
    if 0 <= min(input_ids) and max(input_ids) < vocab_size:  # the common case, without a Python loop
        return None
    index, bad = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    return (f"{field}[{index}] = {bad} is not a token id of this model: token ids must be in "
            f"[0, {vocab_size}) (vocabulary size {vocab_size})")


def logprob_fields_error(top_logprobs_num: Any, logprob_start_len: Any, vocab_size: int) -> Optional[str]:
    """Why a request's logprob fields cannot be served, or None. SGLang's sampler runs ``topk``
    with ``top_logprobs_num``; its prompt-logprob bookkeeping asserts on a ``logprob_start_len``
    below -1 (-1 means "from the output on"; one past the prompt is upstream's own 400)."""
    if isinstance(top_logprobs_num, int) and not 0 <= top_logprobs_num <= vocab_size:
        return (f"top_logprobs_num = {top_logprobs_num} must be in [0, {vocab_size}] "
                f"(vocabulary size {vocab_size})")
    if isinstance(logprob_start_len, int) and logprob_start_len < -1:
        return f"logprob_start_len = {logprob_start_len} must be -1 (output tokens only) or at least 0"
    return None


def _serves_ours(model_config) -> bool:
    return ARCH in (getattr(model_config.hf_config, "architectures", None) or [])


def validate_one_request(original, manager, obj, input_ids, *args, **kwargs):
    """Before upstream's checks of one (sub-)request: its final prompt ids and logprob fields.

    Runs before upstream's, so that ids past the context length are judged too (with
    ``--allow-auto-truncate`` upstream would cut them off). Raises ValueError (HTTP 400).
    """
    if _serves_ours(manager.model_config) and getattr(obj, "input_embeds", None) is None:
        vocab_size = manager.model_config.vocab_size
        # ids the tokenizer made from text: name the text, the user sent no ids
        field = "input_ids" if obj.input_ids is not None else "the tokenized text"
        error = prompt_ids_error(input_ids if input_ids is not None else [], vocab_size, field)
        if error is None and getattr(obj, "return_logprob", False):
            error = logprob_fields_error(getattr(obj, "top_logprobs_num", 0),
                                         getattr(obj, "logprob_start_len", -1), vocab_size)
        if error is not None:
            raise ValueError(error)
    return original(manager, obj, input_ids, *args, **kwargs)


def _vocab_size_if_ours() -> Optional[int]:
    """The served model's vocabulary size in the HTTP process, None for another model (or
    before the server's state is set, when ``validate_one_request`` still guards)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    state = get_global_state()
    manager = getattr(state, "tokenizer_manager", None)
    if manager is None or not _serves_ours(manager.model_config):
        return None
    return manager.model_config.vocab_size


def generate_contract_error(result: Optional[str], body: Any, *args, **kwargs) -> Optional[str]:
    """After upstream's ``/generate`` body check: a bad prompt id is a 400 before any stream."""
    if result is not None or not isinstance(body, dict):
        return result
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        return result  # no ids, or upstream's own "input_ids cannot be empty"
    vocab_size = _vocab_size_if_ours()
    if vocab_size is None:
        return result
    batched = isinstance(ids[0], list)
    for b, one in enumerate(ids if batched else [ids]):
        # a malformed element (a float, a bool, a nested list) is the body parser's to refuse;
        # the types' set is one C-level pass (a 64K-token prompt: ~0.9 ms, ~2.5 ms as a generator)
        if isinstance(one, list) and (not one or set(map(type, one)) == {int}):
            error = prompt_ids_error(one, vocab_size, f"input_ids[{b}]" if batched else "input_ids")
            if error is not None:
                return error
    return result


def register(hook_registry, hook_type) -> None:
    """Install the request checks (called from ``plugin.register``; patches/request-validation.md)."""
    hook_registry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                           validate_one_request, hook_type.AROUND)
    hook_registry.register("sglang.srt.entrypoints.api_contract.generate_contract_error",
                           generate_contract_error, hook_type.AFTER)
