#!/usr/bin/env bash
# The GPU measurements the current tree owes (docs/benchmarks.md, "Not measured on the current
# tree"), as stages meant to fit a 10-minute call each, in the order a loaned H200 should take them. Every
# stage writes its JSON and log under $OUT (default ./gpu-out); MLX's CUDA build must be importable
# (on a loaned machine: scripts/bench/device_kit.sh here, scripts/bench/device_setup.sh there).
#
#   bash scripts/bench/gpu_owed.sh startup   # first on a fresh machine: its caches are still empty
#   bash scripts/bench/gpu_owed.sh installs  # a pass's install by cache size (a write per slot, one scatter, the bank copy); the cache's own install, views kept or built (~3 min)
#   bash scripts/bench/gpu_owed.sh mma       # rows_mma's tensor-core forms: each probe case, then kernel_bench
#   bash scripts/bench/gpu_owed.sh tensor-cores  # 80B and GPT-OSS compares, tensor cores on / off alternating
#   bash scripts/bench/gpu_owed.sh tc-forms  # 80B compares with each form of rows_mma left out in turn (~6 min)
#   bash scripts/bench/gpu_owed.sh new-forms # the same for the plain GLU and column-mapped forms (~6 min)
#   bash scripts/bench/gpu_owed.sh small-ops # the embedding by T and a KV row's write by cache size, each op alone (~1 min)
#   bash scripts/bench/gpu_owed.sh kernels   # the reduce-scatter tail against the butterfly, alternating
#   bash scripts/bench/gpu_owed.sh compare   # 80B shape against mlx-lm: float32 + bfloat16 identity, prefill
#   bash scripts/bench/gpu_owed.sh tail      # the same 80B compare with the butterfly tail, to set beside it
#   bash scripts/bench/gpu_owed.sh gpt-oss   # GPT-OSS-20B shape (4 layers, MXFP4 experts) against mlx-lm, identity
#   bash scripts/bench/gpu_owed.sh profile   # where the T = 8 window's extra time goes (step_profile, launch_cost)
#   bash scripts/bench/gpu_owed.sh share     # each kernel's share of a T = 1 and a T = 8 window, launched twice in place
#   bash scripts/bench/gpu_owed.sh ncu       # every kernel of a T = 1 and a T = 8 window timed by Nsight Compute (~4 min)
#   bash scripts/bench/gpu_owed.sh upload    # host ints through MLX's pool against plain arrays: ncu, then compares (~5 min; UPLOAD_ROUNDS=0: ncu only)
#   bash scripts/bench/gpu_owed.sh routed-loop  # 80B compares, the routed GLU on FMA (the default) against tensor cores at 4/1/1 (~4 min)
#   bash scripts/bench/gpu_owed.sh plain-loop   # the plain tensor-core forms' K loop at 4/4/1, 8/8/1, 16/16/1, 8/8/2, 4/4/4 under ncu (~4 min)
#   bash scripts/bench/gpu_owed.sh glu-unroll   # the routed GLU's lane loop unrolled and its columns a warp: kernel medians, then ncu windows (~4 min)
#   bash scripts/bench/gpu_owed.sh attention-warps  # the attention window at 8 and 16 warps a block, 512 and 4,096 cells (~1 min)
#   bash scripts/bench/gpu_owed.sh attention-split  # splits of 1,024, 512, 256 cells against one kernel to 16,384 cells; windows under ncu at 512 and 4,096 (~6 min)
#   bash scripts/bench/gpu_owed.sh mma-loop  # rows_mma's K loop settings (tiles a block, steps in flight), kernel by kernel (~6 min)
#   bash scripts/bench/gpu_owed.sh stream    # the 48-layer streamed checkpoint: build, disk, cold rows (~15 min)
#   bash scripts/bench/gpu_owed.sh stream-auto      # then auto against serial at 5%, 10% and 100%, 3 rounds alternating
#   bash scripts/bench/gpu_owed.sh stream-depth     # then demand-first reads at 10% and 25% (--readahead-depth 8)
#   bash scripts/bench/gpu_owed.sh stream-prob      # read-ahead of likely picks only (p >= 0.3) at 10% and 25%
#   VERSUS_BASE=DIR bash scripts/bench/gpu_owed.sh versus  # d8d28df's files in DIR against this tree, alternating:
#                                   # the demo sampled, streamed, warm prompts, launch to first token; the 80B shape's (~20 min)
#   bash scripts/bench/gpu_owed.sh selftest  # `strata selftest` as a fresh machine runs it (empty caches), then again
#   STAGES="installs small-ops profile" bash scripts/bench/gpu_owed.sh sequence  # those stages in turn
#   bash scripts/bench/gpu_owed.sh background STAGE [WAIT]  # STAGE in the background (unless one runs), wait
#                                   # up to WAIT s (540), then pack the results into this call's $OUT/gpu-owed.tgz
#
# A stage longer than a call (stream) runs as `background stream`, called again until it says
# done, then `background stream-depth` and `background stream-prob` (they --resume its JSON). On
# the H200 at 318198f compare took 2.5 min, profile 2, kernels 1.3 and startup 9; at 2dc4962 mma
# took 1, gpt-oss 1.6 and selftest 5.5 (docs/benchmarks.md). The stream stages want a loan of their
# own (other GPU work beside them moves both); STREAM_BUDGET (s) overrides their budgets.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STREAM_DIR=${STREAM_DIR:-/tmp/strata-80b}
tree=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# files are named by the card that measured them ("h200", "h100"): a loan may give either
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE 'h[0-9]{3}' | tr 'A-Z' 'a-z' || true)
card=${card:-gpu}
log() { tee -a "$OUT/$1.log"; }
# the tensor-core stages' short compares: bfloat16 identity, no prefill, the window rounds alternating
short_compare="--repeats 2 --window-repeats 6 --window-rounds 3 --identity-tokens 16 --identity-dtypes bfloat16 --prefill-repeats 0 --no-demo-selftest"
# a short 80B compare after a line of Python that sets a study's value in the process (its figures
# to $OUT/$2, their lines to stage $3's log): compare_after SETUP OUT_NAME STAGE
compare_after() {
    python - --family qwen3_next --layers 8 --bits 4 $short_compare --out "$OUT/$2" <<EOF 2>&1 \
        | grep -E "serial decode|T=1:|T=8:|T8/T1|identity" | log "$3"
import runpy
$1
runpy.run_module("scripts.bench.compare_mlx_lm", run_name="__main__")
EOF
}

case "${1:-}" in
background)
    # A device call's $OUT is new each call and its time is bounded: the stage writes to a folder
    # that outlives the call (BG_DIR), and a later call with the same STAGE (or none) waits again.
    BG_DIR=${BG_DIR:-$HOME/gpu-owed}
    mkdir -p "$BG_DIR"
    stage=${2:-}
    wait_s=${3:-540}
    pid=$(cat "$BG_DIR/bg.pid" 2>/dev/null || true)
    if [ -n "$stage" ] && ! { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }; then
        echo "$stage started $(date -u +%T)" >> "$BG_DIR/stages.log"
        OUT=$BG_DIR setsid nohup bash "$self" "$stage" > "$BG_DIR/$stage.stdout" 2>&1 &
        pid=$!
        echo $pid > "$BG_DIR/bg.pid"
    fi
    deadline=$((SECONDS + wait_s))
    while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        echo "still running: call background again"
    else
        echo "done $(date -u +%T)" | tee -a "$BG_DIR/stages.log"
    fi
    # one archive: a device call brings back only so many files (the H100 loan's third call left
    # most of its JSON behind), and a later call's archive holds everything the earlier ones did
    [ "$(realpath "$BG_DIR")" = "$(realpath "$OUT")" ] || tar czf "$OUT/gpu-owed.tgz" -C "$BG_DIR" .
    tail -n 25 "$BG_DIR"/*.stdout 2>/dev/null | cut -c1-300
    ;;
sequence)
    # one background job for a loan's plan: a stage that fails is logged and the next one runs
    for stage in ${STAGES:?STAGES names the stages to run in turn}; do
        echo "== $stage $(date -u +%T)" | log sequence
        bash "$self" "$stage" || echo "== $stage failed: exit $?" | log sequence
    done
    ;;
startup)
    python -m scripts.bench.startup --fresh parallel --later-runs 3 --process-timeout 240 --budget-seconds 420 \
        --out "$OUT/${card}_startup_$tree.json" 2>&1 | log startup
    ;;
selftest)
    # issue 41: "strata selftest on a fresh GPU machine in minutes, not nine" (9 min 14 s before the kernel
    # workers); the caches strata and MLX keep (XDG_CACHE_HOME, MLX_PTX_CACHE_DIR, CUDA_CACHE_PATH) start empty
    fresh=$(mktemp -d)
    for run in fresh again; do
        start=$SECONDS
        rc=0
        XDG_CACHE_HOME=$fresh/cache MLX_PTX_CACHE_DIR=$fresh/ptx CUDA_CACHE_PATH=$fresh/nv timeout 1200 \
            python -m strata_cli.cli selftest --json > "$OUT/selftest_${run}_$tree.json" 2> "$OUT/selftest_${run}.stderr" || rc=$?
        echo "selftest ($run caches): $((SECONDS - start)) s, exit $rc" | log selftest
    done
    ;;
installs)
    python -m scripts.lab.install_bench --bank-sizes 26 52 128 512 --passes 9 --repeats 8 \
        --out "$OUT/install_by_slots_${card}_$tree.json" 2>&1 | log installs
    python -m scripts.lab.install_bench --bank-sizes 52 512 --passes 1 --repeats 8 \
        --out "$OUT/install_by_slots_p1_${card}_$tree.json" 2>&1 | log installs
    python -m scripts.lab.install_host --rounds 40 --out "$OUT/install_host_${card}_$tree.json" 2>&1 | log installs
    ;;
mma)
    # issue 37: the tensor-core forms' probe, case by case (what fails, if anything), then their times
    # against rows_matvec's FMA forms and MLX (kernel_bench's `kernel` against `fma`)
    python - <<'EOF' 2>&1 | log mma
import time
from metal_shaders import rows_mma
cases = [(what, lambda c=c: rows_mma.check_case(*c)) for what, *c in rows_mma.probe_cases()]
for what, check in [*cases, ("shared rows", rows_mma.check_shared_rows), ("mapped columns", rows_mma.check_mapped_columns)]:
    start = time.perf_counter()
    try:
        error = check()
    except Exception as e:  # a compile or launch error
        error = f"{type(e).__name__}: {str(e)[:1500]}"
    print(f"{what}: {error or 'passed'} ({time.perf_counter() - start:.1f} s)", flush=True)
print("probe:", rows_mma.usable(), rows_mma.status(), flush=True)
EOF
    python -m scripts.bench.kernel_bench --out "$OUT/kernel_bench_mma_$tree.json" 2>&1 | log mma
    python -m scripts.bench.kernel_bench --mxfp4 --out "$OUT/kernel_bench_mxfp4_mma_$tree.json" 2>&1 | log mma
    python -m scripts.bench.kernel_bench --dense --out "$OUT/kernel_bench_dense_mma_$tree.json" 2>&1 | log mma
    ;;
tensor-cores)
    # issues 37 and 34: rows_mma's forms against rows_matvec's FMA forms (STRATA_TENSOR_CORES=0) on
    # one machine, three pairs per shape, alternating; bfloat16 identity in every run
    for round in 1 2 3; do
        for tc in 1 0; do
            for shape in "qwen3_next --layers 8 --bits 4" "gpt_oss --layers 4 --bits 0"; do
                set -- $shape
                echo "== $1 round $round tensor cores $tc" | log tensor-cores
                STRATA_TENSOR_CORES=$tc python -m scripts.bench.compare_mlx_lm --family $shape $short_compare \
                    --out "$OUT/tc_${1}_${round}_tc${tc}_$tree.json" 2>&1 | grep -E "serial decode|T=1:|T=8:|T8/T1|identity" | log tensor-cores
            done
        done
    done
    ;;
tc-forms)
    # issue 37: which tensor-core forms pay on the 80B shape (kernel_bench had the routed gate
    # slower on them at 1 and 8 rows); STRATA_TENSOR_CORES names the forms left on, alternating
    for round in 1 2; do
        for forms in 1 dense,affine,routed dense,affine 0; do
            echo "== qwen3_next round $round forms $forms" | log tc-forms
            STRATA_TENSOR_CORES=$forms python -m scripts.bench.compare_mlx_lm --family qwen3_next --layers 8 --bits 4 \
                $short_compare --out "$OUT/tcf_${round}_${forms//,/-}_$tree.json" 2>&1 | grep -E "serial decode|T=1:|T=8:|T8/T1|identity" | log tc-forms
        done
    done
    ;;
new-forms)
    # issue 37: the newer tensor-core forms (the GLU of one pair: the shared
    # expert; column-mapped: GDN's in_proj), each left out in turn against all on, alternating
    old="dense,affine,routed,glu"
    for round in 1 2; do
        for forms in 1 $old $old,mapped $old,plain-glu; do
            echo "== qwen3_next round $round forms $forms" | log new-forms
            STRATA_TENSOR_CORES=$forms python -m scripts.bench.compare_mlx_lm --family qwen3_next --layers 8 --bits 4 \
                $short_compare --out "$OUT/nf_${card}_${round}_${forms//,/-}_$tree.json" 2>&1 | grep -E "serial decode|T=1:|T=8:|T8/T1|identity" | log new-forms
        done
    done
    ;;
small-ops)
    # issues 37 and 38: the 80B embedding at T = 1..8 (0.26-0.30 ms at T >= 4 in step_profile, ids
    # mapped or not) and whether a KV row's write copies the buffer (install_bench's dynamic form did)
    python -m scripts.lab.small_ops --out "$OUT/small_ops_$tree.json" 2>&1 | log small-ops
    ;;
kernels)
    for round in 1 2; do
        python -m scripts.bench.kernel_bench --out "$OUT/kernel_bench_${tree}_$round.json" 2>&1 | log kernels
        python -m scripts.bench.kernel_bench --butterfly-tail --out "$OUT/kernel_bench_butterfly_$round.json" 2>&1 | log kernels
    done
    python -m scripts.bench.kernel_bench --mxfp4 --out "$OUT/kernel_bench_mxfp4_$tree.json" 2>&1 | log kernels
    python -m scripts.bench.kernel_bench --mxfp4 --butterfly-tail --out "$OUT/kernel_bench_mxfp4_butterfly.json" 2>&1 | log kernels
    python -m scripts.bench.kernel_bench --dense --out "$OUT/kernel_bench_dense_$tree.json" 2>&1 | log kernels
    ;;
compare)
    python -m scripts.bench.compare_mlx_lm --layers 8 --bits 4 --repeats 2 --window-repeats 10 --window-rounds 3 --identity-tokens 48 \
        --identity-dtypes float32,bfloat16 --prefill-tokens 4096 --no-demo-selftest --out "$OUT/compare_${card}_80b_$tree.json" 2>&1 | log compare
    ;;
gpt-oss)
    python -m scripts.bench.compare_mlx_lm --family gpt_oss --layers 4 --bits 0 --repeats 2 --window-repeats 10 --window-rounds 3 \
        --identity-tokens 48 --identity-dtypes bfloat16 --prefill-repeats 1 --no-demo-selftest \
        --out "$OUT/compare_${card}_gpt_oss_$tree.json" 2>&1 | log gpt-oss
    ;;
tail)
    python - --layers 8 --bits 4 --repeats 2 --window-repeats 10 --window-rounds 3 --identity-tokens 48 --identity-dtypes bfloat16 \
        --prefill-repeats 0 --no-demo-selftest --out "$OUT/compare_${card}_80b_butterfly.json" <<'EOF' 2>&1 | log compare
import runpy, sys
from scripts.bench.kernel_bench import use_butterfly_tail
print(f"{use_butterfly_tail()} kernel bodies with the butterfly tail", flush=True)
runpy.run_module("scripts.bench.compare_mlx_lm", run_name="__main__")
EOF
    ;;
profile)
    # a kernel-level profiler would split the T = 8 window's device time by kernel: say which this machine has
    for tool in ncu nsys nvcc; do echo "$tool: $(command -v $tool || echo none)"; done 2>&1 | log profile
    python -m scripts.bench.step_profile --models 80b --windows 1,2,4,8 --out "$OUT/step_profile_${card}_$tree.json" 2>&1 | log profile
    python -m scripts.lab.launch_cost --tag "launch_cost_$tree" 2>&1 | log profile
    ;;
ncu)
    # issue 37: the device's own time per kernel, T = 1 against T = 8 (no host in it), with DRAM bytes and occupancy
    # (DETAIL_KERNELS: ncu's --kernel-name for the detail, e.g. the routed experts alone; DETAIL_TIMEOUT its bound, s)
    python -m scripts.lab.ncu_window --detail --detail-kernels "${DETAIL_KERNELS:-regex:strata_}" \
        --detail-timeout "${DETAIL_TIMEOUT:-420}" \
        --keep "$OUT/ncu_${card}_$tree" --out "$OUT/ncu_window_${card}_$tree.json" 2>&1 | log ncu
    rm -f "$OUT/ncu_${card}_$tree"/*.ncu-rep  # the CSVs hold what the report read; the reports are large
    ;;
upload)
    # issue 37: host ints through MLX's pool, dims and kept constants in device memory (STRATA_HOST_UPLOAD=1,
    # the default since this stage ran at ba1cd33; a window's greedy tokens read back through the pool
    # too since 1c3c6e6) against plain managed arrays (0): each kernel's device time under ncu, then
    # short compares alternating (ncu at a2b63c9: the T = 8 embedding 142 us, a T = 1 combine 200 us;
    # at 1c3c6e6 the T = 8 window's first copy 80-95 us)
    for mode in 0 1; do
        STRATA_HOST_UPLOAD=$mode python -m scripts.lab.ncu_window --keep "$OUT/ncu_upload${mode}_${card}_$tree" \
            --out "$OUT/ncu_upload${mode}_${card}_$tree.json" 2>&1 | grep -v "==PROF==" | log upload
        rm -f "$OUT/ncu_upload${mode}_${card}_$tree"/*.ncu-rep
    done
    for round in $(seq "${UPLOAD_ROUNDS:-2}"); do
        for mode in 0 1; do
            echo "== round $round STRATA_HOST_UPLOAD=$mode" | log upload
            STRATA_HOST_UPLOAD=$mode python -m scripts.bench.compare_mlx_lm --family qwen3_next --layers 8 --bits 4 \
                $short_compare --out "$OUT/upload_${round}_${mode}_$tree.json" 2>&1 | grep -E "serial decode|T=1:|T=8:|T8/T1|identity" | log upload
        done
    done
    ;;
routed-loop)
    # issue 37: the routed GLU join on its FMA form (the default after this stage at 1c3c6e6: STRATA_TENSOR_CORES
    # unset) against its tensor-core form at 4/1/1 (=1, every form), short compares alternating;
    # ROUTED_VARIANTS adds others (4/4/1: the plain forms' loop, no gain at 1c3c6e6)
    for round in 1 2; do
        for variant in ${ROUTED_VARIANTS:-4/1/1 4/1/1:fma-glu}; do
            setting=${variant%%:*}
            forms=1; [ "$variant" = "${variant%:fma-glu}" ] || forms=
            echo "== round $round routed $variant" | log routed-loop
            STRATA_TENSOR_CORES=$forms compare_after "from scripts.lab import mma_loop; mma_loop.apply('$setting', 'routed')" \
                "routed_${round}_${variant//[\/:]/}_$tree.json" routed-loop
        done
    done
    ;;
plain-loop)
    # issue 37: the plain tensor-core forms' K loop by the device's own clock: mma-loop's wall-clock
    # medians of the small shapes are host time (ours ~20 us a call where ncu says 8-9 us), and at
    # T = 8 the device's time is the window's. A 2,048-column projection is 128 blocks of 4 warps,
    # each warp 4 steps of loads one after another; 8 and 16 warps a tile, or 4 steps loaded at
    # once, cut the rounds to 2 or 1. ncu_window under each setting (time only)
    for setting in ${PLAIN_LOOPS:-4/4/1 8/8/1 16/16/1 8/8/2 4/4/4}; do
        echo "== plain $setting" | log plain-loop
        python -m scripts.lab.ncu_window --loop "plain=$setting" --out "$OUT/ncu_plain_${setting//\//}_${card}_$tree.json" \
            2>&1 | grep -v "==PROF==" | grep -E "^T = |qmatvec|glu_qmatvec" | log plain-loop
    done
    ;;
glu-unroll)
    # issue 37: the routed GLU's lane loop unrolled (UNROLL) and its output columns a warp (COLS), as
    # UNROLL/COLS; 4/2 the default. At one row (ncu at 97e7ee1) it reads at 29% of DRAM's peak with 27%
    # of warps active: 640 blocks of 4 warps, one thin wave; 1 column a warp doubles the blocks (56
    # registers by nvcc). Kernel medians with a bits check, then whole windows under ncu (time only)
    python -m scripts.lab.glu_unroll --settings 4/2,4/1,8/1,2/1,1/4 \
        --out "$OUT/glu_unroll_${card}_$tree.json" 2>&1 | log glu-unroll
    for cols in 2 1; do
        python -m scripts.lab.ncu_window --glu-cols $cols \
            --out "$OUT/ncu_glu_cols${cols}_${card}_$tree.json" 2>&1 | grep -v "==PROF==" | log glu-unroll
    done
    ;;
attention-warps)
    # issue 37: the attention window with 16 warps a block against 8 (54 us a layer at T = 1 in ncu at ba1cd33)
    python -m scripts.lab.attention_warps --out "$OUT/attention_warps_${card}_$tree.json" 2>&1 | log attention-warps
    ;;
attention-split)
    # issue 37: in a window the cells come from DRAM and one block a row leaves most SMs idle; 1,024-cell
    # splits took a 4,096-cell window's two attention layers from 744 to 181 us at T = 1 under ncu (H100
    # at 97e7ee1) and are the default since. Kernel medians first, then windows by the device's clock
    # (time only): smaller splits, and splits at the compare's 512 cells (CONTEXT:SPLIT_CELLS, 0 one kernel)
    python -m scripts.lab.attention_warps --warps 8 --split-cells off,1024,512,256 --cells 512,4096,16384 \
        --out "$OUT/attention_split_${card}_$tree.json" 2>&1 | log attention-split
    for case in ${SPLIT_CASES:-512:0 512:256 512:128 4096:1024 4096:512 4096:256}; do
        python -m scripts.lab.ncu_window --context "${case%%:*}" --split-cells "${case##*:}" \
            --out "$OUT/ncu_window_${case%%:*}_c${case##*:}_${card}_$tree.json" 2>&1 | grep -v "==PROF==" | log attention-split
    done
    ;;
mma-loop)
    python -m scripts.lab.mma_loop --out "$OUT/mma_loop_${card}_$tree.json" 2>&1 | log mma-loop
    ;;
share)
    python -m scripts.lab.kernel_share --windows 1,8 --rounds 3 --out "$OUT/kernel_share_${card}_$tree.json" 2>&1 | log share
    ;;
versus)
    # issue 37's "nothing slower than today anywhere": the tree it was filed at (d8d28df, unpacked by
    # `git archive d8d28df | tar -x -C DIR` and carried: a loan's copy has no history) against this one
    base=${VERSUS_BASE:?VERSUS_BASE names the folder the old tree was unpacked into}
    python -m scripts.bench.versus_tree --base-dir "$base" --settings sampled,streamed,prompts,streamed-prompts,first-token \
        --dtype bfloat16 --rounds 2 \
        --out "$OUT/versus_${card}_demo_$tree.json" 2>&1 | log versus
    python -m scripts.bench.versus_tree --base-dir "$base" --settings prefill --prefill-args "--synthetic 80b" --rounds 2 \
        --out "$OUT/versus_${card}_prefill_80b_$tree.json" 2>&1 | log versus
    # the 80B shape as a checkpoint bench opens: mlx-lm's, with a small tokenizer (the random model's ids
    # past its 512 entries decode to nothing; bench's digests of the ids still tell texts apart)
    model=${TMPDIR:-/tmp}/strata-versus-80b
    [ -f "$model/tokenizer.json" ] || python - "$model" <<'EOF' 2>&1 | log versus
import sys
from pathlib import Path
from scripts.bench.compare_mlx_lm import build_checkpoint, tiny_tokenizer
tiny_tokenizer(build_checkpoint(Path(sys.argv[1]), layers=8, tiny=False, bits=4, seed=0), vocab_size=512)
EOF
    python -m scripts.bench.versus_tree --base-dir "$base" --settings sampled,prompts,first-token --model "$model" \
        --workloads copy_edit --modes serial,3 --rounds 1 --out "$OUT/versus_${card}_80b_$tree.json" 2>&1 | log versus
    ;;
stream)
    # the 47.2 GB checkpoint wants the disk to itself: the H100 of 2026-12-05 had 48.2 GB left after
    # installs, profile and switches, not enough; their checkpoints are rebuilt when a stage needs them
    tmp=${TMPDIR:-/tmp}
    rm -rf "$tmp/strata-compare" "$tmp/strata-step-profile" "$tmp/strata-launch-cost" /tmp/strata-step-ops
    python -m scripts.bench.stream_80b --dir "$STREAM_DIR" --budget-seconds "${STREAM_BUDGET:-1200}" --temperatures cold \
        --fractions 0.1 0.25 0.05 0.5 1.0 --json-out "$OUT/${card}_stream_80b_$tree.json" 2>&1 | log stream
    ;;
stream-auto)
    # auto against serial where one run each left it short of 0.97x (5%, 100%; 10% beside them):
    # three rounds, the order turning, each row its median run; then where a warm token's host time
    # goes at 10% (cProfile: "compute" was 137 ms a token on the H100); the stream stage's checkpoint
    python -m scripts.bench.stream_80b --dir "$STREAM_DIR" --budget-seconds "${STREAM_BUDGET:-720}" --temperatures cold \
        --fractions 0.05 0.1 1.0 --modes serial auto --rounds 3 --moce none --disk-seconds 0.5 --profile 0.1 \
        --json-out "$OUT/${card}_stream_auto_rounds_$tree.json" 2>&1 | log stream-auto
    ;;
stream-depth)
    python -m scripts.bench.stream_80b --dir "$STREAM_DIR" --budget-seconds "${STREAM_BUDGET:-420}" --temperatures cold --fractions 0.1 0.25 \
        --readahead-depth 8 --moce none --resume --json-out "$OUT/${card}_stream_80b_$tree.json" 2>&1 | log stream-depth
    ;;
stream-prob)
    python -m scripts.bench.stream_80b --dir "$STREAM_DIR" --budget-seconds "${STREAM_BUDGET:-420}" --temperatures cold --fractions 0.1 0.25 \
        --readahead-min-prob 0.3 --moce none --resume --json-out "$OUT/${card}_stream_80b_$tree.json" 2>&1 | log stream-prob
    ;;
*)
    sed -n '2,/^set -euo/p' "$self" | sed '$d'
    exit 2
    ;;
esac
