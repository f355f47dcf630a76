"""The think budget's hooks into SGLang, one table (patches/thinking-budget.md says why each).

The work is split by process: ``thinking_http`` (tokenizer manager: request fields, 400s, the
grammar key) and ``thinking_grammar`` (scheduler: our grammar object behind SGLang's grammar
backend). When the server runs upstream's ``--enable-strict-thinking`` the HTTP hooks stand
aside and no key of ours reaches the scheduler, so upstream's ``custom_params.thinking_budget``
applies (the benchmark compares both).
"""

from __future__ import annotations

from . import thinking_grammar, thinking_http

_XGRAMMAR = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend"


def register(hook_registry, hook_type) -> None:
    """Install the think-budget hooks (called from ``plugin.register``)."""
    for target, hook, kind in (
        ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat.handle_request",
         thinking_http.chat_handle_request, hook_type.AROUND),
        ("sglang.srt.entrypoints.api_contract.generate_contract_error",
         thinking_http.generate_contract_error, hook_type.AFTER),
        ("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
         thinking_http.after_normalize, hook_type.AFTER),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
         thinking_http.create_tokenized_object, hook_type.AROUND),
        (f"{_XGRAMMAR}.__init__", thinking_grammar.prepare_backend, hook_type.AFTER),
        (f"{_XGRAMMAR}.dispatch_structural_tag", thinking_grammar.dispatch_structural_tag, hook_type.AROUND),
        (f"{_XGRAMMAR}.apply_vocab_mask", thinking_grammar.apply_vocab_mask_cpu, hook_type.AROUND),
    ):
        hook_registry.register(target, hook, kind)
