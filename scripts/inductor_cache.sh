# Sourced by the device scripts (gpu_decode_check.sh, gpu_server_check.sh): Inductor's and Triton's
# compile caches. A cold process compiles the fused ops for a minute or two per config (92 s before
# flash8's first 16K prefill; a flash8 server's first request 70-80 s), most of a call. Carried as
# .inductor-cache/inductor-cache.tar.xz (or its .partNN pieces) they are restored here; at exit
# save_compile_caches puts them back in $OUT/inductor-cache.tar.xz (14 MiB parts when larger):
#   rm -rf .inductor-cache && mkdir .inductor-cache && cp FILES_AT/inductor-cache.tar.xz* .inductor-cache/
# (to carry it beside .srt-site and .whl within 64 MiB, repack it here first, ~3 min on 2 cores:
#  cat FILES_AT/inductor-cache.tar.xz.part* | xz -dc | xz -9e -T2 > .inductor-cache/inductor-cache.tar.xz)
# A directory of compile caches must be the cache itself: TORCHINDUCTOR_CACHE_DIR pointed at the
# carried folder (which holds the archive) compiles cold.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache TRITON_CACHE_DIR=/tmp/inductor-cache/triton
if ls .inductor-cache/inductor-cache.tar.xz* >/dev/null 2>&1 && [ ! -d /tmp/inductor-cache ]; then
  cat $(ls .inductor-cache/inductor-cache.tar.xz* | sort) > /tmp/inductor-cache.tar.xz
  python3 -c "import tarfile; tarfile.open('/tmp/inductor-cache.tar.xz').extractall('/tmp', filter='data')" \
    && echo "compile caches: warm ($(du -sh /tmp/inductor-cache | cut -f1))"
fi

save_compile_caches() {
  [ "${SAVE_COMPILE_CACHES:-1}" = 1 ] || return 0
  python3 - "$OUT" <<'PY'
import os, shutil, subprocess, sys, tarfile
out = os.path.join(sys.argv[1], "inductor-cache.tar.xz")
if not os.path.isdir("/tmp/inductor-cache"):
    sys.exit(0)
for old in [f for f in os.listdir(sys.argv[1]) if f.startswith("inductor-cache.tar.xz")]:
    os.remove(os.path.join(sys.argv[1], old))  # an earlier save in this call (a second server)
if shutil.which("xz"):  # all cores (the H200 image has no xz: there the preset-1 fallback runs)
    subprocess.run(f"tar -C /tmp -cf - inductor-cache | xz -6 -T0 > {out}", shell=True, check=True)
else:
    with tarfile.open(out, "w:xz", preset=1) as t:  # fast: the caches are mostly text
        t.add("/tmp/inductor-cache", arcname="inductor-cache")
size, part = os.path.getsize(out), 14 * 2**20  # $OUT hands back files of up to 15 MiB
if size > part:  # in parts (.part00, .part01, ...), which the restore above concatenates
    with open(out, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part), b"")):
            with open(f"{out}.part{i:02d}", "wb") as p:
                p.write(chunk)
    os.remove(out)
print(f"compile caches: {size / 2**20:.1f} MiB compressed")
PY
}
