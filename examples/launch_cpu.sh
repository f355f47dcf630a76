#!/usr/bin/env bash
# Serve the micro tiny V4 on a CPU-only machine (built on first use), with metrics and a 64 MiB
# snapshot budget. Any sglang.launch_server argument can be added.
set -euo pipefail
exec python -m sglang_dsv4.launch_server --model-path micro --port 30000 \
    --enable-metrics --dsv4-snapshot-budget-mb 64 "$@"
