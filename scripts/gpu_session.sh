#!/usr/bin/env bash
# gpu_session.sh: one lent GPU session, prepared: the records the emulator still lacks first,
# then the general check, all inside $BUDGET_S seconds (default 400: a 420 s device call).
#
#   bash scripts/gpu_session.sh .whl      # on the GPU machine, $OUT set by it: the device call
#                                         # carries .whl (cp ../shared/gpu-wheels/*.whl .whl/)
#   GPU_SESSION_DRY=1 OUT=/tmp/s bash scripts/gpu_session.sh   # the plumbing, on a CPU box
#   (GPU_SESSION_PARTS: gpu_measure.py's parts instead of the five below; GPU_CHECK_STEPS
#   reaches gpu_check.sh)
#
# Order (what decides an open accuracy gap first; each step cut to what is left):
#  1 install   the wheels into /tmp/site (no index), this checkout on the machine's own torch
#  2 measure   gpu_measure.py: conv-split (each convolution's backward as cuDNN's two calls),
#              segments-classifier:16:plain (the segments behind classifier's reserved, 4 %
#              above the emulator's), expandable-classifier:16:plain (the same under
#              expandable segments: the emulator's model of them has no measurement yet),
#              rank-classifier and rank-convnet (a fresh DDP rank's steps), nccl-clique
#              (torch.cuda.nccl's communicator, DataParallel's kind, then a process group's),
#              cudnn-benchmark (the workspaces with torch.backends.cudnn.benchmark on, the
#              first call's trials included)
#  3 compare   emulator_vs_gpu.py for the convolution workloads, each in a process of its own
#  4 check     gpu_check.sh (its own steps and summary) in the time left
# Everything lands under $OUT: measure/measure.json, compare.jsonl, gpu/ and steps.tsv.
set -uo pipefail

START=$(date +%s)
BUDGET_S=${BUDGET_S:-400}
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
REPO=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-$(command -v python || command -v python3)}
DRY=${GPU_SESSION_DRY:-0}
printf 'step\trc\tseconds\n' > "$OUT/steps.tsv"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME SHARE_S CMD...: run CMD for at most SHARE_S seconds (and never past the budget,
# keeping 20 s for what follows), its output to $OUT/NAME.log, rc and seconds to steps.tsv
step() {
  local name=$1 share=$2 t0 rc limit
  shift 2
  limit=$(( $(left) - 20 ))
  [ "$share" -lt "$limit" ] && limit=$share
  if [ "$limit" -lt 15 ]; then
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    return 0
  fi
  t0=$(date +%s)
  echo "== [$(( $(date +%s) - START ))s] $name (at most ${limit}s)" >&2
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  tail -n 3 "$OUT/$name.log" >&2
}

if [ "$DRY" = 1 ]; then
  export GPU_MEASURE_DRY=1 GPU_CHECK_DRY=1
else
  WHEELS=${1:?the folder of the shared wheels (carried with the checkout)}
  step install 120 bash -c "pip install -q --no-index --no-deps --target /tmp/site \
    '$WHEELS'/*.whl && PYTHONPATH=/tmp/site pip install -q --no-deps --no-build-isolation -e ."
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1
fi

PARTS=${GPU_SESSION_PARTS:-conv-split,segments-classifier:16:plain,expandable-classifier:16:plain,rank-classifier,rank-convnet,nccl-clique,cudnn-benchmark}
step measure 110 env OUT="$OUT/measure" "$PY" scripts/gpu_measure.py --deadline-s 100 \
  --parts "$PARTS"
if [ "$DRY" = 1 ]; then
  step compare 30 "$PY" benchmarks/emulator_vs_gpu.py --help  # it needs a GPU: the CLI only
else
  step compare 80 "$PY" benchmarks/emulator_vs_gpu.py --workloads classifier,convnet \
    --batch 16 --gpus 1
  cp benchmarks/emulator_vs_gpu.jsonl "$OUT/compare.jsonl" 2>/dev/null
fi
step check "$(( $(left) - 5 ))" env HARD_S=$(( $(left) - 30 )) OUT="$OUT/gpu" \
  bash scripts/gpu_check.sh
echo "done in $(( $(date +%s) - START )) s: $OUT" >&2
