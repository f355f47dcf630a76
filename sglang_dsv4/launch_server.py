"""Launch SGLang's server for a V4 model, on GPU or on a CPU-only machine.

    python -m sglang_dsv4.launch_server --model-path {micro,tiny,DIR} [SGLang server arguments]

``--dsv4-snapshot-budget-mb N`` bounds the memory of fork-point snapshots (LRU beyond it);
``--dsv4-attention-backend {auto,torch,torch-fp8,flashmla}`` picks the cache's storage format and
attention kernel (auto: FlashMLA on SM90/SM100 GPUs, float32 rows and torch elsewhere);
``--dsv4-cuda-graph-max-bs N`` replays decode steps of up to N requests from CUDA graphs on a GPU
(default: SGLang's max running requests; 0 turns them off, as SGLang's ``--disable-cuda-graph`` does);
``--dsv4-cuda-graph-precapture-len N`` captures them at start-up for requests of up to N tokens
(every batch bucket at each entry-table width up to N; default 0: each shape on its first use).
``--dsv4-weights {auto,bf16,fp8}`` picks the matrices' precision on the device (``kernels.weight_mode``:
bf16 = dequantised; fp8 = the checkpoint's fp8 block-128 matrices kept, fp4 experts converted to fp8
exactly; auto = fp8 on an SM90+ GPU with a checkpoint of fp4/fp8 experts, bf16 elsewhere).
``--dsv4-deterministic`` makes every position's result independent of how its sequence is chunked
and batched on the GPU too (``core.model``'s deterministic mode; the CPU path is so already).
``--model-path micro`` / ``tiny`` builds that tiny checkpoint on first use (cached under
``$SGLANG_DSV4_CACHE``, default ``~/.cache/sglang_dsv4``). Without CUDA the launcher makes SGLang
run on the CPU: ``SGLANG_USE_CPU_ENGINE=1``, a pure-torch ``sgl_kernel`` stand-in ahead of
site-packages (SGLang imports it before plugins run), torch-native attention and sampling, no
CUDA graphs, float32, a KV cap so the pool is not sized from system RAM, and
``--sleep-on-idle`` (an idle scheduler waits on its sockets instead of busy-polling a whole core).
Arguments given on the command line always win over these defaults.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .srt.pool_sizing import (ATTENTION_BACKEND_KEY, CUDA_GRAPH_MAX_BS_KEY, CUDA_GRAPH_PRECAPTURE_KEY,
                               DETERMINISTIC_KEY, SNAPSHOT_BUDGET_KEY, WEIGHTS_KEY)

TINY_PRESETS = ("micro", "tiny")
# SGLang server arguments for a CPU-only machine (as ServerArgs field names; True = a flag).
CPU_DEFAULTS: dict[str, object] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "dtype": "float32",
    "max_total_tokens": 65536,
    "max_running_requests": 16,
    "chunked_prefill_size": 2048,
    "disable_cuda_graph": True,
    "sleep_on_idle": True,
}
SHIM_DIR = Path(__file__).parent / "srt" / "cpu_shim"


def cpu_environment(env: dict[str, str], ranks: int = 1) -> dict[str, str]:
    """The environment SGLang needs on a CPU-only machine (see patches/cpu-launcher.md).

    With several ranks (``--tp-size``): the cores split evenly between them (SGLang otherwise
    wants a NUMA node per rank), and SGLang's NCCL wrapper pointed at no library, so its CPU
    groups use gloo instead of trying to build an NCCL communicator on the CPU (which fails when
    the installed torch brings libnccl).
    """
    env = dict(env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM_DIR), env.get("PYTHONPATH")]))
    if ranks > 1:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if len(cores) < ranks:
            raise SystemExit(f"--tp-size: {ranks} CPU ranks need at least {ranks} cores, this machine has {len(cores)}")
        share = len(cores) // ranks
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(
            f"{cores[r * share]}-{cores[(r + 1) * share - 1]}" for r in range(ranks)))
        env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    return env


def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_DSV4_CACHE", Path.home() / ".cache" / "sglang_dsv4"))


def resolve_model_path(args: list[str]) -> list[str]:
    """Replace ``--model-path micro|tiny`` by the path of that tiny checkpoint, built if needed."""
    out = list(args)
    for i, a in enumerate(out):
        name = None
        if a in ("--model-path", "--model") and i + 1 < len(out):
            name, idx = out[i + 1], i + 1
        elif a.startswith("--model-path="):
            name, idx = a.split("=", 1)[1], i
        if name in TINY_PRESETS:
            from .tiny import ensure_tiny

            path = str(ensure_tiny(name, 0, cache_dir()))
            out[idx] = path if idx != i else f"--model-path={path}"
    return out


def cpu_arguments(args: list[str]) -> list[str]:
    """SGLang arguments for the CPU, the user's own taking precedence."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    extra: list[str] = []
    for name, value in CPU_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if flag not in given:
            extra += [flag] if value is True else [flag, str(value)]
    return list(args) + extra


def _non_negative(parse, what: str):
    """A value parser: ``parse(value)`` >= 0, else an exit naming the flag and ``what`` it wants."""
    def parser(flag: str, value: str):
        try:
            x = parse(value)
        except ValueError:
            raise SystemExit(f"{flag}: expected {what}, got {value!r}") from None
        if x < 0:
            raise SystemExit(f"{flag}: must be >= 0, got {value}")
        return x
    return parser


_budget_mb = _non_negative(float, "a number of MiB")
_graph_max_bs = _non_negative(int, "a batch size (0 = no CUDA graphs)")
_precapture_len = _non_negative(int, "a request length in tokens (0 = capture on first use)")


def _attention_backend(flag: str, value: str) -> str:
    from .kernels.dispatch import BACKEND_NAMES

    if value not in BACKEND_NAMES:
        raise SystemExit(f"{flag}: expected one of {', '.join(BACKEND_NAMES)}, got {value!r}")
    return value


def _weights(flag: str, value: str) -> str:
    from .kernels.weight_mode import UNAVAILABLE_MODES, WEIGHT_MODES

    if value in UNAVAILABLE_MODES:
        raise SystemExit(f"{flag} {value}: not available: {UNAVAILABLE_MODES[value]}")
    if value not in WEIGHT_MODES:
        raise SystemExit(f"{flag}: expected one of {', '.join(WEIGHT_MODES)}, got {value!r}")
    return value


def check_weights_here(args: list[str], cuda: bool) -> None:
    """``--dsv4-weights fp8`` without a CUDA device: the error at once, before SGLang starts."""
    for i, a in enumerate(args):
        flag, _, inline = a.partition("=")
        value = inline or (args[i + 1] if i + 1 < len(args) else "")
        if flag == "--dsv4-weights" and value == "fp8" and not cuda:
            from .kernels.weight_mode import WeightModeError, select_weight_mode

            try:
                select_weight_mode("fp8", "cpu")
            except WeightModeError as e:
                raise SystemExit(str(e)) from None


# our flags -> (model config override key our model reads, value parser)
DSV4_FLAGS = {
    "--dsv4-snapshot-budget-mb": (SNAPSHOT_BUDGET_KEY, _budget_mb),
    "--dsv4-attention-backend": (ATTENTION_BACKEND_KEY, _attention_backend),
    "--dsv4-cuda-graph-max-bs": (CUDA_GRAPH_MAX_BS_KEY, _graph_max_bs),
    "--dsv4-cuda-graph-precapture-len": (CUDA_GRAPH_PRECAPTURE_KEY, _precapture_len),
    "--dsv4-weights": (WEIGHTS_KEY, _weights),
}
# our switches (no value) -> the model config override key set to true
DSV4_SWITCHES = {
    "--dsv4-deterministic": DETERMINISTIC_KEY,
}


def dsv4_arguments(args: list[str]) -> list[str]:
    """Our ``--dsv4-*`` flags -> entries of SGLang's ``--json-model-override-args`` (our model
    reads them from its config); every other argument passes through."""
    out, overrides = [], {}
    it = iter(args)
    for a in it:
        flag, _, inline = a.partition("=")
        if flag in DSV4_SWITCHES:
            if inline:
                raise SystemExit(f"{flag}: takes no value (got {inline!r})")
            overrides[DSV4_SWITCHES[flag]] = True
            continue
        if flag not in DSV4_FLAGS:
            out.append(a)
            continue
        value = inline if inline else next(it, None)
        if value is None:
            raise SystemExit(f"{flag}: expected a value")
        key, parse = DSV4_FLAGS[flag]
        overrides[key] = parse(flag, value)
    if not overrides:
        return out
    if "--json-model-override-args" in out:
        i = out.index("--json-model-override-args")
        out[i + 1] = json.dumps({**json.loads(out[i + 1]), **overrides})
    else:
        out += ["--json-model-override-args", json.dumps(overrides)]
    return out


def _parallel_ranks(args: list[str]) -> int:
    """Scheduler processes the arguments ask for on this machine (tp x pp x dp). Data-parallel
    attention (``--attn-dp-size N``, or the older ``--dp-size N --enable-dp-attention``) splits the
    TP ranks into attention groups and adds no processes."""
    ranks = 1
    dp_flags = () if "--enable-dp-attention" in args else ("--dp-size", "--dp")
    for names in (("--tp-size", "--tp"), ("--pp-size",), dp_flags):
        for i, a in enumerate(args):
            flag, _, inline = a.partition("=")
            if flag in names:
                ranks *= int(inline or args[i + 1])
                break
    return ranks


def build_command(argv: list[str], cuda: bool) -> tuple[list[str], dict[str, str]]:
    check_weights_here(argv, cuda)
    args = dsv4_arguments(resolve_model_path(argv))
    env = dict(os.environ)
    if not cuda:
        args = cpu_arguments(args)
        env = cpu_environment(env, _parallel_ranks(args))
    return [sys.executable, "-m", "sglang.launch_server", *args], env


def main(argv: list[str] | None = None) -> None:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    if not any(a == "--model-path" or a.startswith("--model-path=") or a == "--model" for a in argv):
        argv = ["--model-path", "micro", *argv]
    cmd, env = build_command(argv, torch.cuda.is_available())
    print("sglang_dsv4: " + " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
