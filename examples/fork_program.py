"""A frontend-language program that forks: three answers share the question's prefix.

    python examples/fork_program.py [--url http://127.0.0.1:30000] [--budgets 0,16,64]

The branches resume from the fork point's snapshot instead of recomputing the shared prefix;
`cached_tokens` in each branch's meta info shows it, on the first run too: SGLang's frontend
fills the shared text before the branches only when the program's text was synced before
`s.fork` (it is not here: the fork comes right after `s +=`), and `ThinkingEndpoint` fills it
itself when SGLang did not. Each branch thinks within its own budget (`gen(...,
max_thinking_tokens=N)`), then answers.
"""

import argparse

import sglang as sgl

from sglang_dsv4.lang import ThinkingEndpoint, gen


@sgl.function
def three_answers(s, question, budgets):
    s += "<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>" + question + "<｜Assistant｜><think>"
    forks = s.fork(len(budgets))
    for f, budget in zip(forks, budgets):
        f += gen("answer", max_tokens=96, temperature=0.7, max_thinking_tokens=budget)
    return [(f["answer"], f.get_meta_info("answer")) for f in forks]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--budgets", default="0,16,64", help="one think budget per branch")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    state = three_answers.run(question="Why do sliding-window caches need a ring buffer?", budgets=budgets,
                              backend=ThinkingEndpoint(args.url))
    for i, (answer, meta) in enumerate(state.ret_value):
        print(f"branch {i}: budget={budgets[i]} cached_tokens={meta.get('cached_tokens')} "
              f"prompt_tokens={meta.get('prompt_tokens')} answer={answer!r}")
