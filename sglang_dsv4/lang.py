"""SGLang's frontend language against our server: think budgets per ``gen``, fork points filled.

    import sglang as sgl
    from sglang_dsv4.lang import ThinkingEndpoint, gen

    @sgl.function
    def program(s, question):
        s += "<｜begin▁of▁sentence｜><｜User｜>" + question + "<｜Assistant｜><think>"
        s += gen("out", max_tokens=64, max_thinking_tokens=16, regex="(yes|no)")

    state = program.run(question="Is 7 prime?", backend=ThinkingEndpoint(url, thinking_budget=64))

- ``gen(..., max_thinking_tokens=N)`` (``sgl.gen``'s arguments plus the budget) bounds that one
  generation; it needs a ``ThinkingEndpoint`` (a plain ``RuntimeEndpoint`` rejects it with
  "Invalid dtype" rather than ignoring it). ``sgl.gen`` has no budget argument and the frontend
  copies only its own fields from a ``gen`` to the request, so the budget rides in the one field
  it copies as an object (``dtype``) and the endpoint takes it back out before sending.
- ``ThinkingEndpoint(..., thinking_budget=N)`` is the default for every generation whose text
  ends inside a think section (the program wrote ``<think>``); a ``gen``'s own budget wins and is
  sent even outside a think section (the server answers 400 there). May be changed between runs.
- **Fork points on the first run.** SGLang's ``s.fork(n)`` fills the shared text first (a
  ``max_new_tokens=0`` request, so the branches find it cached and our server snapshots the fork
  point) only when the program's text was already synced: the fork reads ``s.text_`` before the
  worker thread has appended what the program just added, sees it empty and skips the fill, and
  the branches then prefill the shared text side by side. This endpoint fills it itself, once,
  before the first branch's first request (the other branches wait for it).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Optional

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.ir import SglGen
from sglang.utils import http_request

THINK_START, THINK_END = "<think>", "</think>"
FILLED_PREFIXES = 256  # fork texts remembered as filled (per endpoint, least recently used dropped)


def ends_inside_think(text: str) -> bool:
    """Whether the text's last think marker opens a think section."""
    return text.rfind(THINK_START) > text.rfind(THINK_END)


class _Budgeted:
    """A ``gen``'s dtype with its think budget attached (see the module docstring)."""

    def __init__(self, dtype: Any, budget: int) -> None:
        self.dtype, self.budget = dtype, budget

    def __repr__(self) -> str:
        return f"max_thinking_tokens={self.budget} (needs sglang_dsv4.lang.ThinkingEndpoint)"


def gen(name: Optional[str] = None, *, max_thinking_tokens: Optional[int] = None, **kwargs: Any) -> SglGen:
    """``sgl.gen`` with a think budget of its own (tokens, >= 0; 0: no thinking)."""
    expr = sgl.gen(name, **kwargs)
    if max_thinking_tokens is None:
        return expr
    if isinstance(max_thinking_tokens, bool) or not isinstance(max_thinking_tokens, int) or max_thinking_tokens < 0:
        raise ValueError(f"max_thinking_tokens must be a non-negative integer, got {max_thinking_tokens!r}")
    if not isinstance(expr, SglGen):
        raise ValueError("max_thinking_tokens does not apply to choices (a select generates nothing)")
    expr.sampling_params.dtype = _Budgeted(expr.sampling_params.dtype, max_thinking_tokens)
    return expr


class ThinkingEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that sends think budgets (per ``gen`` or a default for generations
    inside ``<think>``) and fills each fork point before its branches run."""

    def __init__(self, *args: Any, thinking_budget: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.thinking_budget = thinking_budget
        self._filled: OrderedDict[str, None] = OrderedDict()
        self._fill_lock = threading.Lock()

    # ---- think budgets ------------------------------------------------------------------------

    def generate(self, s, sampling_params, *args: Any, **kwargs: Any):
        budget = self._take_budget(sampling_params)
        self._fill_fork_point(s)
        s._dsv4_gen_budget = budget  # read in _add_images; one generation at a time per executor
        try:
            return super().generate(s, sampling_params, *args, **kwargs)
        finally:
            s._dsv4_gen_budget = None

    def generate_stream(self, s, sampling_params, *args: Any, **kwargs: Any):
        budget = self._take_budget(sampling_params)
        self._fill_fork_point(s)
        s._dsv4_gen_budget = budget
        try:
            yield from super().generate_stream(s, sampling_params, *args, **kwargs)
        finally:
            s._dsv4_gen_budget = None

    @staticmethod
    def _take_budget(sampling_params) -> Optional[int]:
        """The ``gen``'s own budget, with its real dtype put back."""
        if isinstance(sampling_params.dtype, _Budgeted):
            budgeted = sampling_params.dtype
            sampling_params.dtype = budgeted.dtype
            return budgeted.budget
        return None

    def _add_images(self, s, data: dict) -> None:
        # Every /generate body of RuntimeEndpoint passes through here right before it is sent.
        super()._add_images(s, data)
        params = data.get("sampling_params") or {}
        if params.get("max_new_tokens") == 0:
            return  # a fill: nothing is generated
        budget = getattr(s, "_dsv4_gen_budget", None)
        if budget is not None:
            data["max_thinking_tokens"] = budget
        elif (self.thinking_budget is not None and isinstance(data.get("text"), str)
              and ends_inside_think(data["text"])):
            data["max_thinking_tokens"] = self.thinking_budget

    # ---- fork points --------------------------------------------------------------------------

    def commit_lazy_operations(self, s) -> None:
        super().commit_lazy_operations(s)  # SGLang's own fork fill (when the text was synced)
        with self._fill_lock:
            self._remember(_text_key(s.text_))

    def _fill_fork_point(self, s) -> None:
        """Before a fork branch's request: fill the fork's shared text if nobody did."""
        pos = getattr(s, "fork_start_text_pos", None)
        if not pos:
            return
        prefix = s.text_[:pos]
        key = _text_key(prefix)
        with self._fill_lock:  # siblings wait here until the first one has filled
            if key in self._filled:
                self._filled.move_to_end(key)
                return
            data = {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
            RuntimeEndpoint._add_images(self, s, data)
            res = http_request(self.base_url + "/generate", json=data, api_key=self.api_key, verify=self.verify)
            self._assert_success(res)
            self._remember(key)

    def _remember(self, key: str) -> None:
        self._filled[key] = None
        self._filled.move_to_end(key)
        while len(self._filled) > FILLED_PREFIXES:
            self._filled.popitem(last=False)


def _text_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()
