#!/usr/bin/env bash
# The kit a GPU loan needs, made here: MLX's CUDA build (90 MB) in three parts, the MLX, mlx-lm and
# rich-click wheels, and MLX's compiled-kernel cache (../shared/device/ptx-cache.tgz), in .whl-a/,
# .whl-b/ and .whl-c/ (ignored by git), each well under one call's 64 MiB carry.
#
#   bash scripts/bench/device_kit.sh [MLX_VERSION] [MLX_LM_VERSION]     # here: 0.32.4 and 0.32.2
#
# Then on the loan, three calls without a pause (the machine goes back ~30 s after a call):
#   1. carry .whl-a:  mkdir -p /root/keep && cp .whl-a/part_* /root/keep/
#   2. carry .whl-b:  cp .whl-b/part_* /root/keep/
#   3. carry .whl-c:  bash scripts/bench/device_setup.sh && . /root/env.sh && \
#        STAGES="installs profile" bash scripts/bench/gpu_owed.sh background sequence 540
# and later calls `. /root/env.sh && bash scripts/bench/gpu_owed.sh background "" 540` wait for the
# stages again and bring back what they wrote.
set -euo pipefail
mlx=${1:-0.32.4}
mlx_lm=${2:-0.32.2}
root=$(git rev-parse --show-toplevel)
cd "$root"
ptx=${PTX_CACHE:-$root/../shared/device/ptx-cache.tgz}
for d in /.whl-a/ /.whl-b/ /.whl-c/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$tmp/wheels" "mlx-cuda-13==$mlx" "mlx==$mlx" "mlx-lm==$mlx_lm" rich-click
rm -rf .whl-a .whl-b .whl-c
mkdir -p .whl-a .whl-b .whl-c
cuda=$(ls "$tmp"/wheels/mlx_cuda_13-*.whl)
split -b 36000000 "$cuda" "$tmp/part_"
mv "$tmp/part_aa" .whl-a/
mv "$tmp/part_ab" .whl-b/
mv "$tmp"/part_* .whl-c/
basename "$cuda" > .whl-c/NAME
rm "$cuda"
mv "$tmp"/wheels/*.whl .whl-c/
cp "$ptx" .whl-c/ptx-cache.tgz
du -sh .whl-a .whl-b .whl-c
