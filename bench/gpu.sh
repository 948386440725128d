#!/usr/bin/env bash
# The GPU path in one script that a freshly lent GPU machine runs once, whole, from a clean checkout: it installs the
# project (torch from the machine's own CUDA build, within pyproject's range), then runs each leg in its own process
# and prints ONE JSON line at the end even when a leg fails (that leg holds its error and the tail of its log):
#
#   peak            measured bf16 matmul peak (8192^2) and the datasheet's, the two denominators of every MFU
#   train_124m      compiled training steps at the tendril-124m shape (bf16, micro-batch 16, accumulation 8)
#   train_400m      the same at tendril-400m
#   fsdp2_124m      the 124M step under torchrun with FSDP2 over every GPU present (NCCL, even on one GPU)
#   gg_train_124m   `gg train` of the 124M recipe on synthetic shards: the real loop (loader, clipping, logging,
#                   validation, a checkpoint), tokens/s from its metrics.jsonl
#   decode          KV-cache decoding at batch 1 and 32
#   attention       the causal SDPA kernel forward + backward, and packed documents on flex_attention vs SDPA
#   rl_124m         RL steps of the rl stage's loader and loss (rollouts on our KV cache, then the update), 124M shape
#
# Every leg's MFU is tokens/s x FLOPs/token / (peak x ranks) against both peaks, computed once in `summary`.
# Budget: under 8 minutes on one H100/H200, install included.
#
#   bash bench/gpu.sh              # on the GPU machine, from the repository root
#   bash bench/gpu.sh --smoke      # CPU, tiny shapes, gloo, no install: what CI runs (tests/test_gpu_bench.py)
set -uo pipefail            # no -e: a failing leg is recorded, the others still run
cd "$(dirname "$0")/.."
SMOKE=""; INSTALL=1
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE="--smoke"; INSTALL=0 ;;
    --no-install) INSTALL=0 ;;
    *) echo "usage: bash bench/gpu.sh [--smoke] [--no-install]" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
PY="${PYTHON:-python}"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if [ "$INSTALL" = 1 ]; then   # the project and its dependencies; an already installed CUDA torch in range is kept
  if $PY -m pip install -q -e . > "$OUT/install.log" 2>&1 \
     || $PY -m pip install -q --no-build-isolation --no-deps -e . >> "$OUT/install.log" 2>&1; then
    echo "ok: $($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)" > "$OUT/install.txt"
  else echo "failed: $(tail -1 "$OUT/install.log")" > "$OUT/install.txt"; fi
else echo "skipped" > "$OUT/install.txt"; fi

leg() {   # leg NAME LIMIT_S COMMAND...: run it, keep its log; a leg that writes no JSON gets its error recorded
          # (`single`: several legs in one process; the summary marks those it did not finish)
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ "$name" != single ] && [ ! -s "$OUT/$name.json" ]; then
    local why="exit status $rc"; [ "$rc" = 124 ] && why="timed out after ${limit}s"
    printf '{"error": "%s"}' "$why" > "$OUT/$name.json"
  fi
}
NGPU=1
[ -z "$SMOKE" ] && NGPU=$($PY -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)
[ -n "$SMOKE" ] && NGPU=2   # two gloo ranks on the CPU
L="$PY bench/gpu_legs.py"
if [ -n "$SMOKE" ]; then leg single 240 $L "$OUT" peak train_124m train_400m decode attention rl_124m $SMOKE
else
  leg peak 60 $L "$OUT" peak
  leg train_124m 120 $L "$OUT" train_124m
  leg train_400m 150 $L "$OUT" train_400m
  leg decode 60 $L "$OUT" decode
  leg attention 90 $L "$OUT" attention
  leg rl_124m 90 $L "$OUT" rl_124m
fi
leg fsdp2_124m 120 $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" bench/gpu_legs.py "$OUT" fsdp2_124m $SMOKE
leg gg_train_124m 180 $L "$OUT" gg_train_124m $SMOKE
$L summary "$OUT" $SMOKE
