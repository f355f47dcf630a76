"""Structured output through the OpenAI client: the answer must validate against a JSON schema.

    python examples/json_schema_openai.py [--url http://127.0.0.1:30000/v1]
"""

import argparse
import json

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "population_millions": {"type": "number"},
                   "is_capital": {"type": "boolean"}},
    "required": ["city", "population_millions", "is_capital"],
    "additionalProperties": False,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:30000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="none")
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        max_tokens=128, temperature=0)
    answer = json.loads(reply.choices[0].message.content)
    print(json.dumps(answer, indent=2))
    print("cached prompt tokens:", getattr(reply.usage, "prompt_tokens_details", None))
