#!/usr/bin/env bash
# Run HERE once: SonicMoE's wheels for the GPU machine (python 3.12, CUDA 13), in two carry sets
# under .sonic/ (git-ignored), since they pass one call's 64 MiB: .sonic/a holds the first 50 MB
# of the CuTe DSL libraries' wheel, .sonic/b the rest of it and the six small wheels. Carry
# .sonic/a in one device call and .sonic/b in the next, the machine still warm
# (scripts/device_check.sh keeps the parts in /tmp and installs once both are there):
#   run(carry [".whl", ".git-sha", ".sonic/a"]): bash scripts/device_check.sh python -c pass
#   run(carry [".whl", ".git-sha", ".sonic/b"]): bash scripts/device_check.sh suite bench moe-bwd --preset olmoe
# Its metadata pins torch <= 2.9.1; it runs on the machine's torch 2.11, installed --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.sonic/' .git/info/exclude 2>/dev/null || echo '/.sonic/' >> .git/info/exclude
rm -rf .sonic && mkdir -p .sonic/a .sonic/b .sonic/download
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .sonic/download \
  sonic-moe==0.1.2.post1 quack-kernels==0.4.1 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2
big=$(ls .sonic/download/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b 50M "$big" ".sonic/part-"
mv .sonic/part-aa .sonic/a/
mv .sonic/part-a? .sonic/b/
basename "$big" > .sonic/b/joined-name
find .sonic/download -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .sonic/b/ \;
rm -rf .sonic/download
du -sh .sonic/a .sonic/b
