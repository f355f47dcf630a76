"""Launch SGLang's server for a V4 model, on GPU or on a CPU-only machine.

    python -m sglang_dsv4.launch_server --model-path {micro,tiny,DIR} [SGLang server arguments]

``--dsv4-snapshot-budget-mb N`` bounds the memory of fork-point snapshots (LRU beyond it).
``--model-path micro`` / ``tiny`` builds that tiny checkpoint on first use (cached under
``$SGLANG_DSV4_CACHE``, default ``~/.cache/sglang_dsv4``). Without CUDA the launcher makes SGLang
run on the CPU: ``SGLANG_USE_CPU_ENGINE=1``, a pure-torch ``sgl_kernel`` stand-in ahead of
site-packages (SGLang imports it before plugins run), torch-native attention and sampling, no
CUDA graphs or overlap scheduling, float32, a KV cap so the pool is not sized from system RAM, and
``--sleep-on-idle`` (an idle scheduler waits on its sockets instead of busy-polling a whole core).
Arguments given on the command line always win over these defaults.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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
    "disable_overlap_schedule": True,
    "sleep_on_idle": True,
}
SHIM_DIR = Path(__file__).parent / "srt" / "cpu_shim"


def cpu_environment(env: dict[str, str]) -> dict[str, str]:
    """The environment SGLang needs on a CPU-only machine (see patches/cpu-launcher.md)."""
    env = dict(env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM_DIR), env.get("PYTHONPATH")]))
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


def snapshot_budget_argument(args: list[str]) -> list[str]:
    """``--dsv4-snapshot-budget-mb N`` -> the model config override our model reads."""
    out, budget = [], None
    it = iter(args)
    for a in it:
        if a == "--dsv4-snapshot-budget-mb":
            budget = next(it, None)
        elif a.startswith("--dsv4-snapshot-budget-mb="):
            budget = a.split("=", 1)[1]
        else:
            out.append(a)
    if budget is None:
        return out
    try:
        value = float(budget)
    except ValueError:
        raise SystemExit(f"--dsv4-snapshot-budget-mb: expected a number of MiB, got {budget!r}") from None
    if value < 0:
        raise SystemExit(f"--dsv4-snapshot-budget-mb: must be >= 0, got {budget}")
    if "--json-model-override-args" in out:
        i = out.index("--json-model-override-args")
        overrides = json.loads(out[i + 1])
        overrides["dsv4_snapshot_budget_mb"] = value
        out[i + 1] = json.dumps(overrides)
    else:
        out += ["--json-model-override-args", json.dumps({"dsv4_snapshot_budget_mb": value})]
    return out


def build_command(argv: list[str], cuda: bool) -> tuple[list[str], dict[str, str]]:
    args = snapshot_budget_argument(resolve_model_path(argv))
    env = dict(os.environ)
    if not cuda:
        args = cpu_arguments(args)
        env = cpu_environment(env)
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
