#!/usr/bin/env bash
# Run HERE once: SonicMoE for the GPU machine (python 3.12, CUDA 13) as one carry set,
# .sonic/site/sonic-site.tar.xz (git-ignored): its seven wheels' files unpacked and packed again
# with xz, 55 MB where the wheels take 97 (the CuTe DSL libraries' wheel alone 81), so that it
# travels with the project in one call's 64 MiB (xz takes about 3.5 min on two cores).
#   run(carry [".whl", ".git-sha", ".sonic/site"]): bash scripts/device_check.sh suite bench moe-bwd --preset olmoe
# scripts/device_check.sh unpacks it once a machine; its metadata pins torch <= 2.9.1, and it
# runs on the machine's torch 2.11 with no dependency resolved (the files are simply on the path).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.sonic/' .git/info/exclude 2>/dev/null || echo '/.sonic/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/download" \
  sonic-moe==0.1.2.post1 quack-kernels==0.4.1 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2
mkdir -p "$work/site"
for wheel in "$work"/download/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
rm -rf .sonic/site && mkdir -p .sonic/site
tar cf - -C "$work" site | xz -9e -T0 > .sonic/site/sonic-site.tar.xz
du -sh .sonic/site
