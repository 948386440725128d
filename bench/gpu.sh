#!/usr/bin/env bash
# The GPU path in one script that a freshly lent GPU machine runs once, whole, from a clean checkout, inside one
# 10-minute command: it makes a venv, installs a torch that the machine's driver can run (chosen from the driver
# version), then runs each leg in its own process under a global deadline. Each leg appends ONE JSON line to
# OUT/legs.jsonl as it ends (a failed leg holds its error, a skipped one says why), so a run killed midway still
# leaves every finished leg; the last stdout line is the summary of them all.
#
#   peak            measured bf16 matmul peak (8192^2) and the datasheet's, the two denominators of every MFU
#   train_124m      compiled training steps at the tendril-124m shape (bf16, micro-batch 16, accumulation 8)
#   collectives     real collectives between processes: NCCL across the GPUs, or on one GPU two ranks over gloo
#   fsdp2_124m      the 124M step under torchrun with FSDP2 over every GPU present
#   attention       the causal SDPA kernel forward + backward, and packed documents on flex_attention vs SDPA
#   decode          KV-cache decoding at batch 1 and 32
#   gg_train_124m   `gg train` of the 124M recipe on synthetic shards: the real loop (loader, clipping, logging,
#                   validation, a checkpoint), tokens/s from its metrics.jsonl
#   rl_124m         RL steps of the rl stage's loader and loss (rollouts on our KV cache, then the update), 124M shape
#   train_400m      the 124M step at tendril-400m
#
# The legs run in that order (the most telling first). A leg starts only when the time left before the deadline is
# at least its `need`, and runs under `timeout min(cap, time left)`; the others are skipped with a line saying so.
#
#   bash bench/gpu.sh                        # on the GPU machine, from the repository root
#   bash bench/gpu.sh --out "$OUT" --deadline 480 --legs peak,train_124m
#   bash bench/gpu.sh --smoke                # CPU, tiny shapes, gloo, no install: what CI runs (tests/test_gpu_bench.py)
#   bash bench/gpu.sh --choose-torch         # only say which torch wheel index this machine's driver runs, and why
set -uo pipefail            # no -e: a failing leg is recorded, the others still run
cd "${0%/*}/.." || exit 2
SMOKE=""; INSTALL=1; DEADLINE=480; LEGS_ARG=""; OUT=""; CHOOSE=0
usage="usage: bash bench/gpu.sh [--smoke] [--no-install] [--deadline S] [--legs a,b,c] [--out DIR] [--choose-torch]"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE="--smoke"; INSTALL=0 ;;
    --no-install) INSTALL=0 ;;
    --choose-torch) CHOOSE=1 ;;
    --deadline) DEADLINE=${2:-}; shift ;;
    --legs) LEGS_ARG=${2:-}; shift ;;
    --out) OUT=${2:-}; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
case "$DEADLINE" in ''|*[!0-9]*) echo "--deadline takes whole seconds, got '$DEADLINE'" >&2; exit 2 ;; esac

# ---------------------------------------------------------------- which torch the driver runs
# Minimum Linux x86_64 drivers, from NVIDIA's CUDA Toolkit release notes (table 3, "CUDA Toolkit and Corresponding
# Driver Versions") and its "Minor Version Compatibility" guide (CUDA 12.x runs on >= 525 drivers below 580, CUDA
# 13.x needs >= 580): CUDA 12.0 GA 525.60.13, 12.6 GA 560.28.03, 12.8 GA 570.26, 12.9 GA 575.51.03, 13.0 GA
# 580.65.06. torch 2.9 publishes cu126, cu128 and cu130 wheels (pytorch.org "previous versions") and none for CUDA 11;
# from 2.12 the 12.x wheels are cu129 and PyPI's default is CUDA 13 (pytorch's 2.12 release announcement), so a
# 12.x driver tries cu129, cu128, cu126 in turn: the newest torch in range that it runs. A wheel for a newer 12.x
# than the driver's own runs by minor-version compatibility (its kernels are compiled for sm_90: no PTX JIT on Hopper).
driver_key() {   # driver_key 550.54.15 -> 550054015 (each field below 1000; a missing field counts 0)
  local IFS=. a b c
  read -r a b c _ <<< "$1"
  echo $(( 10#${a:-0} * 1000000 + 10#${b:-0} * 1000 + 10#${c:-0} ))
}
choose_torch() {   # prints "INDEX[,FALLBACK] REASON" or "none REASON": one line, from `nvidia-smi` on PATH only
  local out v k
  if ! command -v nvidia-smi > /dev/null 2>&1; then
    echo "none: no nvidia-smi on PATH, so no NVIDIA driver to run a CUDA torch"; return
  fi
  if ! out=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1); then
    echo "none: nvidia-smi failed: ${out%%$'\n'*}"; return
  fi
  v=${out%%$'\n'*}; v=${v//[[:space:]]/}
  case "$v" in ''|*[!0-9.]*) echo "none: nvidia-smi reported no driver version ('$v')"; return ;; esac
  k=$(driver_key "$v")
  if (( k >= 580000000 )); then
    echo "cu130,cu129 driver $v >= 580 runs CUDA 13.x wheels (13.0 GA needs 580.65.06)"
  elif (( k >= 575051003 )); then
    echo "cu129,cu128,cu126 driver $v >= 575.51.03 runs CUDA 12.9 natively; cu130 needs >= 580"
  elif (( k >= 570026000 )); then
    echo "cu129,cu128,cu126 driver $v >= 570.26 runs CUDA 12.8 natively, 12.9 by minor-version compatibility;" \
         "cu130 needs >= 580"
  elif (( k >= 560028003 )); then
    echo "cu129,cu128,cu126 driver $v >= 560.28.03 runs CUDA 12.6 natively, 12.8-12.9 by minor-version" \
         "compatibility; cu130 needs >= 580"
  elif (( k >= 525060013 )); then
    echo "cu129,cu128,cu126 driver $v runs CUDA 12.x wheels only by minor-version compatibility (>= 525.60.13);" \
         "cu130 needs >= 580"
  else
    echo "none: driver $v is older than 525.60.13, the least that runs a CUDA 12 wheel; torch>=2.9 has no CUDA 11 wheel"
  fi
}
if [ "$CHOOSE" = 1 ]; then choose_torch; exit 0; fi

# ---------------------------------------------------------------- output, clock, log lines
START=$SECONDS
if [ -z "$OUT" ]; then
  if [ -n "$SMOKE" ]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gg_gpu_smoke.XXXXXX")
  else printf -v OUT 'bench/out/gpu-%(%Y%m%d-%H%M%S)T' -1; fi
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
: > "$OUT/legs.jsonl"
say() { echo "gpu.sh: $*" >&2; echo "$*" >> "$OUT/notes.txt"; }
say "results in $OUT (one line per leg in legs.jsonl), deadline ${DEADLINE}s"
left() { echo $(( DEADLINE - (SECONDS - START) )); }
jstr() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/ }; s=${s//$'\t'/ }; printf '"%s"' "$s"; }
line() {   # line LEG KEY TEXT: the leg's JSON file and its line in legs.jsonl, for a leg that wrote none itself
  printf '{%s: %s}\n' "$(jstr "$2")" "$(jstr "$3")" > "$OUT/$1.json"
  printf '{"leg": %s, %s: %s}\n' "$(jstr "$1")" "$(jstr "$2")" "$(jstr "$3")" >> "$OUT/legs.jsonl"
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
VENV=bench/out/gpu-venv      # ignored by git; a warm machine reuses it
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$VENV/bin/python" ]; then PY=$VENV/bin/python
  elif [ "$INSTALL" = 1 ]; then
    # --system-site-packages: a CUDA torch the image already holds is kept when it runs here
    if command -v python3 > /dev/null && timeout 60 python3 -m venv --system-site-packages "$VENV" >> "$OUT/install.log" 2>&1
    then PY=$VENV/bin/python
    else say "no venv: 'python3 -m venv' failed (see install.log; Debian/Ubuntu need python3-venv); using python3 as is"
         rm -rf "$VENV"; PY=python3; fi
  else PY=python3; fi
fi

# ---------------------------------------------------------------- install, only what is missing, under a timeout
deps_missing() {   # the requirements of pyproject.toml that this Python lacks (torch: also when CUDA does not run)
  timeout 60 "$PY" - "$1" <<'EOF'
import re, sys
from importlib.metadata import version, PackageNotFoundError
text = open("pyproject.toml").read()
deps = re.findall(r'"([^"]+)"', re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1))
try: from packaging.requirements import Requirement
except ImportError: from pip._vendor.packaging.requirements import Requirement
for d in deps:
    r = Requirement(d)
    if r.marker and not r.marker.evaluate(): continue
    try: ok = r.specifier.contains(version(r.name), prereleases=True)
    except PackageNotFoundError: ok = False
    if ok and r.name == "torch" and sys.argv[1] == "cuda":
        import torch
        ok = torch.version.cuda is not None and torch.cuda.is_available()
    if not ok: print(d)
EOF
}
pip_install() {   # pip_install LIMIT ARGS...: pip under a wall-clock limit, short network timeouts and one retry
  local limit=$1; shift
  timeout "$limit" "$PY" -m pip install -q --timeout 20 --retries 1 "$@" >> "$OUT/install.log" 2>&1
}
TORCH_NOTE="" INSTALL_TXT="skipped"
if [ "$INSTALL" = 1 ]; then
  choice=$(choose_torch); TORCH_NOTE="torch: $choice"; say "$TORCH_NOTE"
  mapfile -t missing < <(deps_missing cuda 2>> "$OUT/install.log")
  need_torch=0; others=()
  for d in "${missing[@]}"; do case "$d" in torch*) need_torch=1 ;; *) others+=("$d") ;; esac; done
  if [ "$need_torch" = 1 ]; then
    spec=$(grep -o '"torch[^"]*"' pyproject.toml | tr -d '"')
    if [ "${choice%% *}" = "none:" ]; then say "no torch installed: ${choice#none: }"
    else
      ok=0 first=${choice%% *} force=()
      # last, the configured index (a mirror may not reach download.pytorch.org): for a 12.x driver only torch 2.9,
      # whose PyPI wheels are CUDA 12.8 builds
      pypi_spec=$spec; case "$first" in cu130*) ;; *) pypi_spec="torch>=2.9,<2.10" ;; esac
      for idx in ${first//,/ } pypi; do
        budget=$(( $(left) - 120 )); (( budget > 240 )) && budget=240
        if (( budget < 30 )); then say "no time left to install torch from $idx"; break; fi
        if [ "$idx" = pypi ]; then args=("$pypi_spec"); else
          args=("$spec" --index-url "https://download.pytorch.org/whl/$idx"); fi
        say "installing ${args[*]} (limit ${budget}s)"
        if pip_install "$budget" "${force[@]}" "${args[@]}" &&
           timeout 60 "$PY" -c "import torch; assert torch.cuda.is_available()" >> "$OUT/install.log" 2>&1
        then ok=1; break; fi
        say "torch from $idx failed, timed out or sees no GPU: $(tail -1 "$OUT/install.log")"
        force=(--force-reinstall)   # a torch that installed but cannot run here must be replaced, not kept
      done
      [ "$ok" = 1 ] || say "no torch installed from ${choice%% *}"
    fi
  fi
  if [ "${#others[@]}" -gt 0 ]; then
    budget=$(( $(left) - 120 )); (( budget > 150 )) && budget=150
    if (( budget >= 20 )); then say "installing ${#others[@]} dependencies (limit ${budget}s)"
         pip_install "$budget" "${others[@]}" || say "dependencies failed or timed out: $(tail -1 "$OUT/install.log")"
    else say "no time left to install ${others[*]}"; fi
  fi
  [ "${#missing[@]}" = 0 ] && say "dependencies already import; nothing installed"
  INSTALL_TXT="$(timeout 60 "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available())' 2>&1 | tail -1)"
fi
echo "$INSTALL_TXT${TORCH_NOTE:+; $TORCH_NOTE}" > "$OUT/install.txt"

# ---------------------------------------------------------------- what can compile, how many GPUs
CUDA_OK=1
if [ -z "$SMOKE" ]; then
  NGPU=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
         2>/dev/null || echo 0)
  case "$NGPU" in ''|*[!0-9]*) NGPU=0 ;; esac
  if [ "$NGPU" = 0 ]; then CUDA_OK=0; say "torch sees no GPU ($(cat "$OUT/install.txt")): the legs are skipped"; fi
  # Triton compiles a C launcher for each kernel: it needs a C compiler and Python.h (torch.compile, flex_attention)
  why=""
  command -v cc > /dev/null || command -v gcc > /dev/null || why="no C compiler (cc)"
  "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"],
"Python.h")))' 2>/dev/null || why="${why:+$why and }no Python.h (python3-dev)"
  if [ -n "$why" ]; then export GG_BENCH_EAGER=1 TORCHDYNAMO_DISABLE=1; say "eager: $why, so nothing is compiled"; fi
else NGPU=2; fi   # two gloo ranks on the CPU

# ---------------------------------------------------------------- the legs
#        name            cap need  (seconds; smoke mode: the one-process legs run together under `single`)
TABLE="peak             45  20
       train_124m      100  60
       collectives      45  25
       fsdp2_124m      100  60
       attention       120  45
       decode           45  20
       gg_train_124m   120  70
       rl_124m          60  30
       train_400m      100  60
       float8_124m     100  60
       float8_400m     100  60"
ONE_PROCESS=" peak train_124m train_400m float8_124m float8_400m decode attention rl_124m "
ALL=$(awk '{print $1}' <<< "$TABLE" | tr '\n' ' ')
SELECTED=" ${ALL} "
if [ -n "$LEGS_ARG" ]; then
  SELECTED=" ${LEGS_ARG//,/ } "
  for l in $SELECTED; do
    case " $ALL " in *" $l "*) ;; *) echo "unknown leg '$l'; legs: $ALL" >&2; exit 2 ;; esac
  done
fi
RESERVE=15; [ -n "$SMOKE" ] && RESERVE=0   # the summary's time
L=("$PY" bench/gpu_legs.py)

leg() {   # leg NAME CAP NEED COMMAND...: run it under the deadline; a leg that writes no JSON gets its error recorded
  local name=$1 cap=$2 need=$3; shift 3
  local t=$(( $(left) - RESERVE ))
  if (( t < need )); then
    local l; if [ "$name" = single ]; then set -- "${group[@]}"; else set -- "$name"; fi
    for l in "$@"; do
      say "skipped $l: needs ${need}s, ${t}s left before the deadline"
      line "$l" skipped "needs ${need}s, ${t}s left before the deadline"
    done; return
  fi
  (( t > cap )) && t=$cap
  local now; printf -v now '%(%s)T' -1
  GG_LEG_DEADLINE=$(( now + t )) timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ "$name" != single ] && [ ! -s "$OUT/$name.json" ]; then
    local why="exit status $rc"; [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timed out after ${t}s"
    line "$name" error "$why"
  fi
  say "$name: done at $(( SECONDS - START ))s"
}
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node)
NCOLL=$NGPU; (( NCOLL < 2 )) && NCOLL=2    # one GPU: two ranks share it over gloo (see leg_collectives)

for l in $ALL; do
  case "$SELECTED" in *" $l "*) ;; *) line "$l" skipped "not in --legs"; continue ;; esac
  if [ "$CUDA_OK" = 0 ]; then line "$l" skipped "no GPU that torch can use"; continue; fi
  read -r _ cap need < <(grep -E "^ *$l " <<< "$TABLE")
  if [ -n "$SMOKE" ]; then
    case "$ONE_PROCESS" in
      *" $l "*)   # the first one-process leg runs all the selected ones in one process (one import of torch)
        [ -n "${SINGLE_DONE:-}" ] && continue; SINGLE_DONE=1; group=()
        for g in $ONE_PROCESS; do case "$SELECTED" in *" $g "*) group+=("$g") ;; esac; done
        now=0; printf -v now '%(%s)T' -1
        GG_BENCH_DEADLINE=$(( now + $(left) )) leg single 240 1 "${L[@]}" "$OUT" "${group[@]}" $SMOKE
        for g in "${group[@]}"; do [ -s "$OUT/$g.json" ] || line "$g" error "not finished by the one-process run"; done
        continue ;;
    esac
    need=1
  fi
  case "$l" in
    fsdp2_124m) leg "$l" "$cap" "$need" "${TR[@]}" "$NGPU" bench/gpu_legs.py "$OUT" "$l" $SMOKE ;;
    collectives) leg "$l" "$cap" "$need" "${TR[@]}" "$NCOLL" bench/gpu_legs.py "$OUT" "$l" $SMOKE ;;
    *) leg "$l" "$cap" "$need" "${L[@]}" "$OUT" "$l" $SMOKE ;;
  esac
done
"${L[@]}" summary "$OUT" $SMOKE | tee "$OUT/summary.json"
