"""A frontend-language program that forks: three answers share the question's prefix.

    python examples/fork_program.py [--url http://127.0.0.1:30000]

The branches resume from the fork point's snapshot instead of recomputing the shared prefix;
`cached_tokens` in each branch's meta info shows it.
"""

import argparse

import sglang as sgl


@sgl.function
def three_answers(s, question):
    s += sgl.system("Answer briefly.")
    s += sgl.user(question)
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0.7 * i))
    return [(f["answer"], f.get_meta_info("answer")) for f in forks]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    state = three_answers.run(question="Why do sliding-window caches need a ring buffer?",
                              backend=sgl.RuntimeEndpoint(args.url))
    for i, (answer, meta) in enumerate(state.ret_value):
        print(f"branch {i}: cached_tokens={meta.get('cached_tokens')} answer={answer!r}")
