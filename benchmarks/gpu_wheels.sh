#!/usr/bin/env bash
# Wheels for the GPU check, made on a machine with a package index: what the GPU image lacks
# (its torch, numpy, pyarrow, rich, safetensors and pytest stay), for Python 3.12 on manylinux
# x86_64. Ray is not among them: its wheel is too large to carry, so the check covers the engine.
#   bash benchmarks/gpu_wheels.sh [DIR]        (default: gpu-wheels/, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-wheels}
mkdir -p "$dir"
python3 -m pip download --quiet --dest "$dir" --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    "pydantic>=2.5,<3" "hjson>=3.1" pytest-timeout
ls "$dir"
