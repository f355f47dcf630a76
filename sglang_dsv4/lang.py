"""Think budgets from SGLang's frontend language.

    import sglang as sgl
    from sglang_dsv4.lang import ThinkingEndpoint

    backend = ThinkingEndpoint("http://127.0.0.1:30000", thinking_budget=64)
    state = program.run(..., backend=backend)

``sgl.gen`` has no budget argument, so the endpoint adds ``max_thinking_tokens`` to each
``/generate`` call whose text ends inside a think section (the program wrote ``<think>``, e.g.
after ``<｜Assistant｜>``); other calls are sent unchanged. ``backend.thinking_budget`` may be
changed between runs.
"""

from __future__ import annotations

from typing import Optional

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

THINK_START, THINK_END = "<think>", "</think>"


def ends_inside_think(text: str) -> bool:
    """Whether the text's last think marker opens a think section."""
    return text.rfind(THINK_START) > text.rfind(THINK_END)


class ThinkingEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that bounds the thinking of every generation made inside ``<think>``."""

    def __init__(self, *args, thinking_budget: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.thinking_budget = thinking_budget

    def _add_images(self, s, data: dict) -> None:
        # Every /generate body of RuntimeEndpoint passes through here right before it is sent.
        super()._add_images(s, data)
        params = data.get("sampling_params") or {}
        if (self.thinking_budget is not None and params.get("max_new_tokens") != 0
                and isinstance(data.get("text"), str) and ends_inside_think(data["text"])):
            data["max_thinking_tokens"] = self.thinking_budget
