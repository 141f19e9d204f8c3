#!/usr/bin/env bash
# On a loaned GPU, from the repo root, once the first two calls left their parts in $KEEP: MLX's
# CUDA build put together and installed with the kit's wheels into $SITE, MLX's kernel cache
# unpacked into $PTX_ROOT/ptx, and $ENV_FILE written for later calls to source (PYTHONPATH,
# MLX_PTX_CACHE_DIR). Does nothing twice. The kit: scripts/bench/device_kit.sh.
set -euo pipefail
KEEP=${KEEP:-/root/keep}
SITE=${SITE:-/tmp/site}
PTX_ROOT=${PTX_ROOT:-/root}
ENV_FILE=${ENV_FILE:-/root/env.sh}
kit=${KIT:-.whl-c}
name=$(cat "$kit/NAME")
if [ ! -f "$SITE/.strata-kit" ]; then
    whl=$(mktemp -d)
    cat "$KEEP"/part_* "$kit"/part_* > "$whl/$name"  # pip reads the package from the file's name
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl/$name" "$kit"/*.whl
    rm -rf "$whl"
    touch "$SITE/.strata-kit"
fi
[ -d "$PTX_ROOT/ptx" ] || tar xzf "$kit/ptx-cache.tgz" -C "$PTX_ROOT"
printf 'export PYTHONPATH=%s:%s\nexport MLX_PTX_CACHE_DIR=%s/ptx\n' "$SITE" "$PWD" "$PTX_ROOT" > "$ENV_FILE"
echo "kit ready: $(ls "$SITE" | grep -c dist-info) packages in $SITE, kernels in $PTX_ROOT/ptx; source $ENV_FILE"
