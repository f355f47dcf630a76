"""Scheduler side of the think budget: our grammar object behind SGLang's grammar interface.

SGLang fills each constrained request's token mask on the CPU, row by row, every decode step
(``SamplingBatchInfo.update_regex_vocab_mask``), so a grammar's per-token cost lands on the step's
critical path once per request. A budget written into xgrammar states (``repeat``/``max_tokens``
N) costs more the larger N is; here the think section is a counter instead:

- thinking: one copy of a precomputed mask row (every token but the specials, ``</think>``
  allowed), or of a one-token row where the closing text and ``</think>`` are forced; O(1) in N;
- answer: the request's JSON schema / regex / EBNF in an xgrammar ``GrammarMatcher`` compiled
  with the special tokens reserved (they match no text, so no per-token exclusion pass), or, for
  free text, one more precomputed row.

``ThinkGrammarFactory`` holds what is shared per grammar backend (the rows, the reserved-specials
compiler); ``dispatch_structural_tag`` (an AROUND hook) turns our grammar keys (``ThinkBound``)
into ``ThinkBudgetGrammar`` objects and passes every other structural tag to xgrammar.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Optional

import numpy as np
import torch
import xgrammar as xgr
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarStats, InvalidGrammarObject

from ..tokenizer_files import THINK_END_ID
from .thinking import TAG_KEY, ThinkBound, answer_exclusions, special_token_ids



def _mask_row(width: int, allowed_len: int, excluded: set[int]) -> torch.Tensor:
    """A bitmask row (xgrammar layout: int32 words, bit t % 32 of word t // 32) allowing token
    ids below ``allowed_len`` except ``excluded``."""
    bits = np.zeros(width * 32, dtype=bool)
    bits[:allowed_len] = True
    bits[sorted(excluded)] = False
    return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").astype(np.int32))


class _Rows:
    """Precomputed mask rows of one (vocabulary, exclusion sets): copied, never recomputed."""

    def __init__(self, width: int, allowed_len: int, think_exclude: set[int], answer_exclude: set[int]):
        self.width = width
        self.think_excluded, self.answer_excluded = frozenset(think_exclude), frozenset(answer_exclude)
        self.think = _mask_row(width, allowed_len, think_exclude)
        self.answer = _mask_row(width, allowed_len, answer_exclude)
        self._single: dict[int, torch.Tensor] = {}

    def single(self, token: int) -> torch.Tensor:
        """The row allowing ``token`` alone (the forced closing text and ``</think>``)."""
        row = self._single.get(token)
        if row is None:
            word, bit = divmod(token, 32)
            row = torch.zeros(self.width, dtype=torch.int32)
            row[word] = (1 << bit) - (1 << 32) if bit == 31 else 1 << bit  # int32 words are signed
            self._single[token] = row
        return row


class ThinkBudgetGrammar(BaseGrammarObject):
    """One request's bound: count think tokens, force the closing text and ``</think>`` at the
    budget, then hand over to the answer's matcher (or the free-answer row)."""

    def __init__(self, bound: ThinkBound, rows: _Rows, answer_ctx: Optional[xgr.CompiledGrammar],
                 stop_tokens: frozenset[int], override_stop_tokens: Any, key_string: str,
                 grammar_stats: Optional[GrammarStats] = None) -> None:
        super().__init__()
        self.bound, self.rows, self.answer_ctx = bound, rows, answer_ctx
        self.stop_tokens, self.override_stop_tokens = stop_tokens, override_stop_tokens
        self.key_string = key_string
        if grammar_stats is None:
            grammar_stats = GrammarStats(dispatch_type="structural_tag")
        self.grammar_stats = grammar_stats
        # xgrammar 0.2.7 keeps unlimited rollback history (its max_rollback_tokens is deprecated)
        self.matcher = None if answer_ctx is None else xgr.GrammarMatcher(
            answer_ctx, override_stop_tokens=override_stop_tokens)
        self.think_len = 0  # think tokens accepted (closing text included, </think> not)
        self.answer_len = -1  # tokens accepted after </think>; -1 while thinking
        self._free_stopped = False  # a free-text answer accepted a stop token

    # ---- state -------------------------------------------------------------------------------

    def accept_token(self, token: int) -> None:
        """Advance by one sampled token; a token the mask did not allow raises (as XGrammarGrammar)."""
        if self.is_terminated():
            return
        self.current_token = token
        if self.answer_len < 0:
            forced = self.bound.forced(self.think_len)
            allowed = token == forced if forced is not None else token not in self.rows.think_excluded
            if not allowed:
                raise ValueError(f"token {token} not allowed after {self.think_len} think tokens "
                                 f"(forced: {forced}); key {self.key_string[:200]}")
            if token == THINK_END_ID:
                self.answer_len = 0
            else:
                self.think_len += 1
            return
        if self.matcher is not None:
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} not accepted by the answer grammar; key {self.key_string[:200]}")
        elif token in self.rows.answer_excluded:
            raise ValueError(f"special token {token} not allowed in the answer")
        elif token in self.stop_tokens:
            self._free_stopped = True
        self.answer_len += 1

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (answer tokens first, then ``</think>``, then thinking)."""
        in_answer = min(k, max(self.answer_len, 0))
        if in_answer:
            if self.matcher is not None:
                self.matcher.rollback(in_answer)
            self._free_stopped = False
            self.answer_len -= in_answer
            k -= in_answer
        if k and self.answer_len == 0:
            self.answer_len = -1
            k -= 1
        self.think_len -= k

    def is_terminated(self) -> bool:
        if self.answer_len < 0:
            return False
        return self.matcher.is_terminated() if self.matcher is not None else self._free_stopped

    # ---- masks -------------------------------------------------------------------------------

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write this request's allowed tokens into row ``idx`` (a CPU bitmask)."""
        if self.answer_len < 0:
            forced = self.bound.forced(self.think_len)
            vocab_mask[idx].copy_(self.rows.think if forced is None else self.rows.single(forced))
        elif self.matcher is not None:
            self.matcher.fill_next_token_bitmask(vocab_mask, idx)
        else:
            vocab_mask[idx].copy_(self.rows.answer)

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        from sglang.srt.utils.common import is_pin_memory_available

        # xgrammar's layout and SGLang's pinning, so rows of other grammars in the batch fit too
        return torch.full(xgr.get_bitmask_shape(batch_size, vocab_size), -1, dtype=xgr.bitmask_dtype,
                          pin_memory=is_pin_memory_available())

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device), backend="cpu")
            return
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        XGrammarGrammarBackend.apply_vocab_mask(logits, vocab_mask)

    def copy(self) -> "ThinkBudgetGrammar":
        """A fresh grammar of the same bound (SGLang caches one per key and copies it per request)."""
        stats = dataclasses.replace(self.grammar_stats, is_cache_hit=True, tree_traversal_time=[])
        return ThinkBudgetGrammar(self.bound, self.rows, self.answer_ctx, self.stop_tokens,
                                  self.override_stop_tokens, self.key_string, stats)

    def try_jump_forward(self, tokenizer) -> None:
        return None  # no jump-forward (SGLang 0.5.23's scheduler never asks)

    def __repr__(self) -> str:
        return f"ThinkBudgetGrammar(remaining={self.bound.remaining}, think_len={self.think_len}, " \
               f"answer_len={self.answer_len})"


class ThinkGrammarFactory:
    """What a grammar backend's think-budget grammars share: mask rows and the answer compiler
    whose tokenizer has the answer-excluded specials reserved (xgrammar otherwise lets them into
    JSON strings, where a decoded ``</think>`` would confuse the reasoning parser)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, vocab_size: int, special_ids: list[int],
                 override_stop_tokens: Any = None):
        self.info, self.vocab_size, self.override_stop_tokens = tokenizer_info, vocab_size, override_stop_tokens
        self.special_ids = special_ids  # the tokenizer's special tokens: what ThinkBound excludes
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]
        # ids past the tokenizer's vocabulary and its empty-text specials are never allowed
        self._absent = set(tokenizer_info.special_token_ids)
        self._allowed_len = min(vocab_size, tokenizer_info.vocab_size)
        self.stop_tokens = frozenset(tokenizer_info.stop_token_ids) | frozenset(
            [override_stop_tokens] if isinstance(override_stop_tokens, int) else override_stop_tokens or [])
        self._rows: dict[tuple, _Rows] = {}
        self._compilers: dict[tuple[int, ...], xgr.GrammarCompiler] = {}
        self._lock = threading.Lock()  # dispatches run in the backend's thread pool

    def rows(self, bound: ThinkBound) -> _Rows:
        key = (bound.think_exclude, bound.answer_exclude)
        with self._lock:
            if key not in self._rows:
                self._rows[key] = _Rows(self.width, self._allowed_len, self._absent | set(bound.think_exclude),
                                        self._absent | set(bound.answer_exclude))
            return self._rows[key]

    def answer_compiler(self, reserved: tuple[int, ...]) -> xgr.GrammarCompiler:
        """A compiler whose reserved tokens match no text (a leading 0xFF is invalid UTF-8, the
        trick of SGLang's ``reserve_framing_tokens``); built once per reserved set (~0.3 s)."""
        with self._lock:
            if reserved not in self._compilers:
                skip = set(reserved)
                vocab = [b"\xff" + piece if i in skip else piece for i, piece in enumerate(self.info.decoded_vocab)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.info.vocab_size,
                                         stop_token_ids=self.info.stop_token_ids)
                self._compilers[reserved] = xgr.GrammarCompiler(info)
            return self._compilers[reserved]

    def compile_answer(self, bound: ThinkBound) -> Optional[xgr.CompiledGrammar]:
        """The answer's compiled grammar (cached by xgrammar per constraint), None for free text."""
        answer, kind = bound.answer, bound.answer.get("type")
        if kind == "any_tokens":
            return None
        compiler = self.answer_compiler(bound.answer_exclude)
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(answer["json_schema"]), any_whitespace=True,
                                                max_whitespace_cnt=answer.get("max_whitespace_cnt"))
        if kind == "regex":
            return compiler.compile_regex(answer["pattern"])
        if kind == "grammar":
            return compiler.compile_grammar(answer["grammar"])
        raise ValueError(f"unknown answer type {kind!r}")

    def create(self, bound: ThinkBound, key_string: str) -> ThinkBudgetGrammar:
        return ThinkBudgetGrammar(bound, self.rows(bound), self.compile_answer(bound), self.stop_tokens,
                                  self.override_stop_tokens, key_string)


def factory_of(backend) -> Optional[ThinkGrammarFactory]:
    """The factory ``prepare_backend`` left on an ``XGrammarGrammarBackend`` (one per scheduler)."""
    return getattr(backend, "_dsv4_think_factory", None)


# ---- hooks (registered by thinking_hooks) -----------------------------------------------------

def dispatch_structural_tag(original, backend, key_string: str, *args, **kwargs):
    """AROUND ``XGrammarGrammarBackend.dispatch_structural_tag``: our keys become our grammar."""
    if TAG_KEY not in key_string:
        return original(backend, key_string, *args, **kwargs)
    factory = factory_of(backend)
    if factory is None:
        return InvalidGrammarObject("think budget grammar: this grammar backend was built without our tokenizer set-up")
    try:
        bound = ThinkBound.from_key(key_string, factory.special_ids)
        if bound is None:
            return original(backend, key_string, *args, **kwargs)
        return factory.create(bound, key_string)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # xgrammar compile errors are RuntimeError
        return InvalidGrammarObject(f"think budget grammar: {e}")


def prepare_backend(result, backend, tokenizer, *args, **kwargs):
    """AFTER ``XGrammarGrammarBackend.__init__``: our factory, from the tokenizer's special tokens;
    for a tokenizer with V4's ``</think>`` the reserved-specials answer compiler is built now, at
    startup (~0.3 s), instead of inside the first budgeted request."""
    specials = special_token_ids(tokenizer)
    factory = ThinkGrammarFactory(backend._tokenizer_info, backend.vocab_size, specials,
                                  backend.override_stop_tokens)
    backend._dsv4_think_factory = factory
    if hasattr(tokenizer, "convert_tokens_to_ids") and tokenizer.convert_tokens_to_ids("</think>") == THINK_END_ID:
        factory.answer_compiler(tuple(answer_exclusions(specials)))
    return result


def apply_vocab_mask_cpu(original, logits: torch.Tensor, vocab_mask: torch.Tensor, *args, **kwargs) -> None:
    """AROUND ``XGrammarGrammarBackend.apply_vocab_mask``: 0.5.23 has no CPU branch; add xgrammar's."""
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device), backend="cpu")
        return None
    return original(logits, vocab_mask, *args, **kwargs)
