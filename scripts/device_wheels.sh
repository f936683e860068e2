#!/usr/bin/env bash
# Run HERE (a machine with PyPI) once: fetch the wheels the GPU machine lacks into .whl/
# (git-ignored), which the device call carries. The GPU image has python 3.12, no pydantic and
# no pytest-xdist (suite run --gpus, pytest --suite -n).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 liger-kernel==0.8.5 \
  pytest-xdist==3.8.0 execnet==2.1.2
ls .whl
