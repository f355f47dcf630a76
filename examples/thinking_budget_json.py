"""A budgeted think + JSON answer through the OpenAI client.

    python -m sglang_dsv4.launch_server --model-path micro --port 30000 --reasoning-parser deepseek-v4
    python examples/thinking_budget_json.py [--url http://127.0.0.1:30000/v1] [--budget 64]

Thinking is on (``chat_template_kwargs.thinking``, the V4 template's flag); the think section is
at most ``--budget`` tokens (the grammar forces ``</think>`` there), and the answer after it must
validate against the schema. ``reasoning_content`` holds the thinking, ``content`` the JSON.
"""

import argparse
import json

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="none")
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Is 91 a prime number?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        max_tokens=256, temperature=0,
        # fields outside the OpenAI SDK's signature travel in extra_body
        extra_body={"chat_template_kwargs": {"thinking": True}, "thinking_budget": args.budget})
    message = reply.choices[0].message
    print("reasoning:", repr(getattr(message, "reasoning_content", None)))
    print("answer:", json.dumps(json.loads(message.content), indent=2))
    print("usage:", reply.usage)
