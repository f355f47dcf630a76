"""Run by test_engine.py in a fresh interpreter: the offline engine, twice the same chat."""

import json
import sys

from sglang_dsv4.engine import make_engine

if __name__ == "__main__":
    engine = make_engine("micro", max_total_tokens=8192, log_level="error")
    try:
        ids = json.loads(sys.argv[1])
        params = {"temperature": 0, "max_new_tokens": 8}
        first = engine.generate(input_ids=ids, sampling_params=params)
        second = engine.generate(input_ids=ids + first["output_ids"] + [7, 8, 9], sampling_params=params)
        print("RESULT " + json.dumps([first["output_ids"], second["output_ids"],
                                      second["meta_info"]["cached_tokens"]]))
    finally:
        engine.shutdown()
