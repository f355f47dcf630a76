"""End-to-end prefix sharing on CPU: our server with the radix cache on and off, side by side.

Replays shortened versions of the simulator's workloads (``traces.WORKLOADS``, fewer sessions and
lengths scaled to the micro model's 4096-token context) through two running
``sglang_dsv4.launch_server --model-path micro`` servers, one with the radix cache and one with
``--disable-radix-cache``, with a multi-turn client: one request at a time in arrival order (as
the simulator serves them), streaming ``/generate`` with ``input_ids``; each output feeds the later
turns through ``traces.realize``. Forks and n>1 are sent the way the server receives them (a
``max_new_tokens=0`` prefill, then the branches / copies). Measures per workload the time to first
token, wall time, token throughput and the cached-token ratio (``meta_info.cached_tokens`` over
prompt tokens), and compares that ratio with ``OursSim``'s prediction for the same realized trace.
Then runs SGLang's ``bench_serving --dataset-name generated-shared-prefix`` against both servers.
Prints a markdown table.

    python -m benchmarks.prefix_sim.serve [--workloads ...] [--seed 0] [--port 32100]
    python -m benchmarks.prefix_sim.serve --url-on http://HOST:P1 --url-off http://HOST:P2

Without ``--url-on/--url-off`` it starts both servers itself (ports ``--port`` and ``--port``+1)
and stops them at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import requests

from . import traces
from .agree import SERVER_CHUNK
from .common import GIB
from .ours import OursSim
from .traces import Request, RequestSpec

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 4096  # the micro model's max_position_embeddings
SNAPSHOT_BUDGET_MB = 64.0  # room for ~286 micro snapshots: the short traces keep at most ~25

# Shortened workloads: (length scale, builder arguments). Fewer sessions/groups/programs than the
# simulator's defaults, and shorter shared_prefix answers, so one pass over both servers takes
# minutes on 2 busy cores (decode, 1-80 tokens/s there, dominates); scales chosen so the longest
# history stays inside the micro model's context and shared_prefix's prompts span a prefill chunk.
SHORT: dict[str, tuple[float, dict[str, int]]] = {
    "chat": (0.15, {"sessions": 2, "turns": 3}),
    "agentic": (0.1, {"sessions": 2, "turns": 4}),
    "shared_prefix": (0.5, {"groups": 2, "per_group": 4, "output_len": 16}),
    "fork_tree": (0.3, {"programs": 1, "depth": 2, "fanout": 2}),
    "n_sampling": (0.05, {"prompts": 2, "n": 3}),
}


def short_specs(name: str, seed: int, scale: float | None = None) -> list[RequestSpec]:
    """The shortened workload ``name``: its ``SHORT`` shape, lengths times ``scale`` (default: its own)."""
    default_scale, kwargs = SHORT[name]
    return traces.WORKLOADS[name](seed, scale=default_scale if scale is None else scale, **kwargs)


def check_fits(name: str, specs: Sequence[RequestSpec], context: int = CONTEXT) -> None:
    """Fail before sending anything if a request would not fit the model's context (output lengths
    are fixed by ``ignore_eos``, so the seeded realization has the server's lengths)."""
    longest = max(len(r.history) for r in traces.realize(specs, traces.seeded_outputs(0)))
    if longest > context:
        raise SystemExit(f"{name}: a history of {longest} tokens exceeds the context of {context}; lower --scale")


# ---- the client ----------------------------------------------------------------------------------
@dataclass
class Sample:
    """One served request."""
    tag: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft: float  # seconds from sending to the first streamed chunk (the only chunk for max_new_tokens=0)


class StreamingClient:
    """An ``OutputFn`` for ``traces.realize``: streams each request to the server and records a ``Sample``."""

    def __init__(self, url: str, tags: Sequence[str]):
        self.url = url.rstrip("/")
        self.tags = list(tags)
        self.samples: list[Sample] = []

    def __call__(self, index: int, prompt: tuple[int, ...], output_len: int) -> tuple[int, ...]:
        body = {"input_ids": list(prompt), "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}}
        start, first, last = time.perf_counter(), None, None
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    first = first or time.perf_counter()
                    last = line
        if last is None:
            raise RuntimeError(f"request {index} ({self.tags[index]}): no streamed output")
        out = json.loads(last[6:])
        if "error" in out:
            raise RuntimeError(f"request {index} ({self.tags[index]}): {out['error']}")
        ids = tuple(out["output_ids"])  # cumulative in SGLang's /generate stream
        if len(ids) != output_len:
            raise RuntimeError(f"request {index}: {len(ids)} output tokens, asked for {output_len}")
        self.samples.append(Sample(self.tags[index], len(prompt), len(ids),
                                   int(out["meta_info"]["cached_tokens"]), first - start))
        return ids


@dataclass
class Run:
    """One workload replayed through one server."""
    workload: str
    cache: str  # "on" / "off"
    samples: list[Sample]
    wall: float
    trace: list[Request] = field(repr=False, default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.samples)

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.samples)

    @property
    def cached_ratio(self) -> float:
        return sum(s.cached_tokens for s in self.samples) / self.prompt_tokens

    @property
    def mean_ttft_ms(self) -> float:
        return 1e3 * statistics.fmean(s.ttft for s in self.samples)

    @property
    def p50_ttft_ms(self) -> float:
        return 1e3 * statistics.median(s.ttft for s in self.samples)

    @property
    def input_tps(self) -> float:
        return self.prompt_tokens / self.wall

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall


def flush(url: str, timeout: float = 300) -> None:
    """Empty the server's cache, so each workload starts from the simulator's empty tree. SGLang
    refuses (400) while a request is still being released after its last streamed chunk: retry."""
    deadline = time.time() + timeout
    while True:
        r = requests.post(url.rstrip("/") + "/flush_cache", params={"timeout": 60}, timeout=120)
        if r.status_code == 200:
            return
        if time.time() > deadline:
            r.raise_for_status()
        time.sleep(0.5)


def replay_server(url: str, workload: str, cache: str, specs: Sequence[RequestSpec]) -> Run:
    """Serve ``specs`` one at a time in arrival order through the server at ``url``."""
    flush(url)
    client = StreamingClient(url, [s.tag for s in specs])
    t0 = time.perf_counter()
    trace = traces.realize(specs, client)
    return Run(workload, cache, client.samples, time.perf_counter() - t0, trace)


def simulate(trace: Sequence[Request], chunk: int = SERVER_CHUNK) -> tuple[list[int], int]:
    """``OursSim``'s cached tokens per request of ``trace`` (the server's chunk size, a budget that
    never evicts) and the snapshots it holds at the end (the most it ever holds, without eviction)."""
    sim = OursSim(1024 * GIB, chunk=chunk)
    return [sim.serve(r) for r in trace], sim.num_snaps


# ---- servers -------------------------------------------------------------------------------------
def server_command(port: int, radix: bool, snapshot_budget_mb: float) -> list[str]:
    """The launcher command for one server. ``--sleep-on-idle``: an idle SGLang scheduler otherwise
    spins a whole core, which on 2 cores would slow the other server down."""
    cmd = [sys.executable, "-m", "sglang_dsv4.launch_server", "--model-path", "micro", "--port", str(port),
           "--dsv4-snapshot-budget-mb", f"{snapshot_budget_mb:g}", "--sleep-on-idle"]
    return cmd + ([] if radix else ["--disable-radix-cache"])


def start_server(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (so it and its children can be stopped together)."""
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 900) -> None:
    """Block until ``url``/health answers 200."""
    deadline = time.time() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise SystemExit(f"server exited with {proc.returncode}:\n{tail}")
        if time.time() > deadline:
            raise SystemExit(f"{url} did not become healthy in {timeout:.0f} s")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


# ---- SGLang's bench_serving ------------------------------------------------------------------------
def bench_serving_command(url: str, tokenizer: str, out: Path, args: argparse.Namespace) -> list[str]:
    """``sglang.bench_serving`` on the generated-shared-prefix dataset, token ids (exact lengths)."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--dataset-name", "generated-shared-prefix", "--tokenizer", tokenizer, "--tokenize-prompt",
            "--gsp-num-groups", str(args.gsp_num_groups), "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
            "--gsp-system-prompt-len", str(args.gsp_system_prompt_len), "--gsp-question-len", str(args.gsp_question_len),
            "--gsp-output-len", str(args.gsp_output_len), "--seed", str(args.seed),
            "--flush-cache", "--cache-report", "--disable-tqdm", "--output-file", str(out)]


def bench_serving(url: str, tokenizer: str, args: argparse.Namespace, workdir: Path, tag: str) -> dict:
    """Run ``bench_serving`` against ``url``; its result record (the last JSONL line)."""
    out = workdir / f"bench_serving_{tag}.jsonl"
    out.unlink(missing_ok=True)
    cmd = bench_serving_command(url, tokenizer, out, args)
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # the tokenizer is a local directory; never download
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    (workdir / f"bench_serving_{tag}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving ({tag}) failed with {res.returncode}: {(res.stdout + res.stderr)[-2000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


# ---- report --------------------------------------------------------------------------------------
HEADER = ("| workload | cache | requests | prompt tokens | measured cached ratio | simulated ratio | mean TTFT ms "
          "| p50 TTFT ms | wall s | input tok/s | output tok/s |\n|---|---|---|---|---|---|---|---|---|---|---|")


def run_row(run: Run, simulated: float) -> str:
    """One table row."""
    return (f"| {run.workload} | {run.cache} | {len(run.samples)} | {run.prompt_tokens} | {run.cached_ratio:.1%} "
            f"| {simulated:.1%} | {run.mean_ttft_ms:.1f} | {run.p50_ttft_ms:.1f} | {run.wall:.1f} "
            f"| {run.input_tps:.0f} | {run.output_tps:.1f} |")


def bench_row(cache: str, r: dict) -> str:
    """One table row from a ``bench_serving`` record (its cache report gives the measured ratio)."""
    cr = r.get("cache_report") or {}
    ratio = cr.get("total_cached_tokens", 0) / max(cr.get("total_prompt_tokens", 0), 1)
    return (f"| bench_serving gsp | {cache} | {r['completed']} | {r['total_input_tokens']} | {ratio:.1%} | - "
            f"| {r['mean_ttft_ms']:.1f} | {r['median_ttft_ms']:.1f} | {r['duration']:.1f} "
            f"| {r['input_throughput']:.0f} | {r['output_throughput']:.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(SHORT), choices=list(SHORT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=None, help="override every workload's length scale")
    ap.add_argument("--port", type=int, default=32100, help="cache-on server port; cache-off gets port+1")
    ap.add_argument("--url-on", help="a running server with the radix cache (instead of starting one)")
    ap.add_argument("--url-off", help="a running server with --disable-radix-cache")
    ap.add_argument("--snapshot-budget-mb", type=float, default=SNAPSHOT_BUDGET_MB)
    ap.add_argument("--log-dir", type=Path, default=None, help="server and bench_serving logs (default: a temp dir)")
    ap.add_argument("--skip-bench-serving", action="store_true")
    ap.add_argument("--gsp-num-groups", type=int, default=2)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=4)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    ap.add_argument("--gsp-question-len", type=int, default=64)
    ap.add_argument("--gsp-output-len", type=int, default=16)
    args = ap.parse_args(argv)
    if (args.url_on is None) != (args.url_off is None):
        ap.error("give both --url-on and --url-off, or neither")

    specs = {name: short_specs(name, args.seed, args.scale) for name in args.workloads}
    for name, s in specs.items():
        check_fits(name, s)
    workdir = args.log_dir or Path(tempfile.mkdtemp(prefix="prefix_serve_"))
    workdir.mkdir(parents=True, exist_ok=True)

    procs: list[subprocess.Popen] = []
    try:
        if args.url_on is None:
            urls = {"on": f"http://127.0.0.1:{args.port}", "off": f"http://127.0.0.1:{args.port + 1}"}
            logs = {c: workdir / f"server_{c}.log" for c in urls}
            for cache, port in (("on", args.port), ("off", args.port + 1)):
                cmd = server_command(port, cache == "on", args.snapshot_budget_mb)
                print("# " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
                procs.append(start_server(cmd, logs[cache]))
            for cache, proc in zip(urls, procs):
                wait_healthy(urls[cache], proc, logs[cache])
        else:
            urls = {"on": args.url_on.rstrip("/"), "off": args.url_off.rstrip("/")}
            for url in urls.values():
                wait_healthy(url, None, None, timeout=30)

        lines, ratios, disagreements, notes = [HEADER], [], [], []
        all_runs: dict[str, list[Run]] = {"on": [], "off": []}
        snapshot_room = int(args.snapshot_budget_mb * 2**20) // _micro_snapshot_bytes()
        for i, name in enumerate(args.workloads):
            # alternate which server goes first, so drift in the machine's load hits both alike
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            runs = {}
            for cache in order:
                runs[cache] = replay_server(urls[cache], name, cache, specs[name])
                print(f"  {name} cache {cache}: {runs[cache].wall:.1f} s", file=sys.stderr, flush=True)
            on, off = runs["on"], runs["off"]
            predicted, snaps = simulate(on.trace)
            (workdir / f"samples_{name}.json").write_text(json.dumps(
                {c: [vars(s) for s in r.samples] for c, r in runs.items()} | {"simulated": predicted}))
            if snaps > snapshot_room:
                notes.append(f"{name}: the simulator holds {snaps} snapshots, the server's budget {snapshot_room}: "
                             "the server may evict some, the simulator does not")
            sim_ratio = sum(predicted) / on.prompt_tokens
            diff = [(s.tag, p, s.cached_tokens) for s, p in zip(on.samples, predicted) if p != s.cached_tokens]
            if diff:
                disagreements.append(f"{name}: {len(diff)} of {len(predicted)} requests differ "
                                     f"(tag, simulated, server): {diff[:5]}")
            if any(s.cached_tokens for s in off.samples):
                notes.append(f"{name}: the cache-off server reported cached tokens")
            rows = [run_row(on, sim_ratio), run_row(off, 0.0)]
            print("\n".join(rows) + ("\n  DIFF " + disagreements[-1] if diff else ""), file=sys.stderr, flush=True)
            lines += rows
            all_runs["on"].append(on)
            all_runs["off"].append(off)
            ratios.append((name, off.mean_ttft_ms / on.mean_ttft_ms, off.p50_ttft_ms / on.p50_ttft_ms,
                           off.wall / on.wall, on.cached_ratio, sim_ratio))

        if len(args.workloads) > 1:  # every request of every workload: the overall on/off ratios
            tot = {c: Run("all", c, [x for r in rs for x in r.samples], sum(r.wall for r in rs))
                   for c, rs in all_runs.items()}
            ratios.append(("all workloads", tot["off"].mean_ttft_ms / tot["on"].mean_ttft_ms,
                           tot["off"].p50_ttft_ms / tot["on"].p50_ttft_ms, tot["off"].wall / tot["on"].wall,
                           tot["on"].cached_ratio, sum(r[5] * o.prompt_tokens for r, o in zip(ratios, all_runs["on"]))
                           / tot["on"].prompt_tokens))

        bench_note = None
        if not args.skip_bench_serving:
            from sglang_dsv4.launch_server import cache_dir
            from sglang_dsv4.tiny import ensure_tiny

            tokenizer = str(ensure_tiny("micro", 0, cache_dir()))
            recs = {}
            try:
                for cache in ("on", "off"):
                    recs[cache] = bench_serving(urls[cache], tokenizer, args, workdir, cache)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                bench_note = f"bench_serving left out: {e}"
            if len(recs) == 2:
                lines += [bench_row("on", recs["on"]), bench_row("off", recs["off"])]
                on_r, off_r = recs["on"], recs["off"]
                ratios.append(("bench_serving gsp", off_r["mean_ttft_ms"] / on_r["mean_ttft_ms"],
                               off_r["median_ttft_ms"] / on_r["median_ttft_ms"],
                               off_r["duration"] / on_r["duration"], None, None))
    finally:
        for proc in procs:
            stop_server(proc)

    print("\n".join(lines))
    print("\n| workload | mean TTFT off/on | p50 TTFT off/on | throughput on/off (= wall off/on) "
          "| cached ratio measured | simulated |\n|---|---|---|---|---|---|")
    for name, mean_r, p50_r, tput_r, meas, sim in ratios:
        m = "-" if meas is None else f"{meas:.1%}"
        s = "-" if sim is None else f"{sim:.1%}"
        print(f"| {name} | {mean_r:.2f}x | {p50_r:.2f}x | {tput_r:.2f}x | {m} | {s} |")
    print()
    print("Simulator vs server, request by request: " + ("all equal" if not disagreements else "DIFFERENT"))
    for d in disagreements + notes + ([bench_note] if bench_note else []):
        print(f"- {d}")
    print(f"(logs: {workdir})", file=sys.stderr)
    return 1 if disagreements else 0


def _micro_snapshot_bytes() -> int:
    """Bytes of one snapshot of the micro model (fp32 ring + compressor state), as the server sizes it."""
    from sglang_dsv4.launch_server import cache_dir
    from sglang_dsv4.memory import cache_bytes
    from sglang_dsv4.tiny import ensure_tiny
    from sglang_dsv4.config import V4Config

    cfg = json.loads((ensure_tiny("micro", 0, cache_dir()) / "config.json").read_text())
    b = cache_bytes(V4Config.from_dict(cfg), "fp32")
    return int(b.window_bytes_per_request + b.compressor_state_bytes_per_request)


if __name__ == "__main__":
    sys.exit(main())
