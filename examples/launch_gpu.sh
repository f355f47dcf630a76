#!/usr/bin/env bash
# Serve a V4 checkpoint on GPUs with plain SGLang: the installed sglang_dsv4 plugin replaces
# upstream's DeepseekV4ForCausalLM with ours. MODEL defaults to the FlashMLA-shaped tiny model.
# V4-Flash (bf16 matrices, ~570 GB) on one 8-GPU H200/B200 node:
#   MODEL=/models/DeepSeek-V4-Flash examples/launch_gpu.sh --tp-size 8 --ep-size 8
set -euo pipefail
MODEL="${MODEL:-$(python -c 'from sglang_dsv4.tiny import ensure_tiny; from sglang_dsv4.launch_server import cache_dir; print(ensure_tiny("tiny", 0, cache_dir()))')}"
exec python -m sglang.launch_server --model-path "$MODEL" --port 30000 \
    --json-model-override-args '{"dsv4_snapshot_budget_mb": 4096}' "$@"
