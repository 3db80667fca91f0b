#!/usr/bin/env bash
# One-shot run on a lent NVIDIA H100/H200, in at most 7 minutes, that cannot lose its
# results:
#   bash benchmarks/gpu.sh              # results in $OUT (or ./gpu-results)
#   bash benchmarks/gpu.sh --dry-run    # the same steps on a CPU, tiny sizes
#                                       # (also MIXPREC_GPU_SH_DRY_RUN=1)
#   bash benchmarks/gpu.sh --plan       # print the plan (step, time box) and exit
# The plan: each step in its own time box (SIGINT at the box's end, so the Python steps
# write what they have; SIGKILL 5 s later); the boxes add up to the budget less the
# summary's reserve (tests/workbench/test_gpu_script.py checks), the most valuable figures first:
#   env          nvidia-smi, versions (rest.tar.gz: env.txt)
#   preflight    benchmarks/gpu_preflight.py: each kernel check in its own process
#   gemm         benchmarks/gpu_gemm.py: bf16 against each format's GEMM, per shape
#   bench:R      benchmarks/gpu_bench.py: the workbench GPT, eager, one process per recipe
#   moe:R        the same on a config-built transformers Qwen3-MoE (fp8-current, mxfp8)
#   grouped      benchmarks/gpu_grouped.py: each grouped GEMM case in its own process
#   tests        the CUDA-marked tests (-m cuda), one time box per test, JUnit XML
#   compile:R    gpu_bench.py --compile: compiled against eager (GPT base; Qwen3-MoE)
# A step that no longer fits is recorded as skipped. summary.txt names what one GPU
# cannot run (TP, FSDP, DDP over NCCL: "not run: needs 2 GPUs").
# Files in $OUT, 8 at most: summary.txt (each step's exit code and wall time, written as
# each ends), tables.md (bench.jsonl as Markdown tables), preflight.jsonl, tests.xml,
# tests.log, bench.jsonl, nvidia-smi.csv (sampled every second), rest.tar.gz (every
# other log, repacked after each step). On SIGTERM/SIGINT/SIGHUP the running step gets
# SIGINT and summary.txt names what did not run.
# Environment: PY (python3), OUT; MIXPREC_GPU_SH_RECIPES="a;b" runs these bench:R
# recipes; MIXPREC_GPU_SH_BOX_SCALE multiplies every box and the budget (default 1;
# 6 in a dry run: a shared CPU is slow); for tests of this script:
# MIXPREC_GPU_SH_FAIL=step[,step] crashes those steps (SIGSEGV; "bench" covers every
# bench:R), MIXPREC_GPU_SH_KILL=step sends this script SIGTERM as that step starts.
set -uo pipefail
export LC_ALL=C
cd "$(dirname "$0")/.."

DRY=${MIXPREC_GPU_SH_DRY_RUN:-0} PLAN_ONLY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --plan) PLAN_ONLY=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg'; valid: --dry-run, --plan, --help" >&2; exit 2 ;;
  esac
done
PY=${PY:-python3}
SCALE=${MIXPREC_GPU_SH_BOX_SCALE:-$([ "$DRY" = 1 ] && echo 6 || echo 1)}
BUDGET=$((420 * SCALE))   # seconds for the whole run
SUMMARY=10                # of which the summary, the tables and the packing at the end
GRACE=5                   # seconds between a step's SIGINT and its SIGKILL

# ---- the plan: step names and boxes (seconds), in order -----------------------------
RECIPES=(bf16-master fp8-current fp8-rowwise int8-rowwise fp8-block mxfp8 nvfp4)
if [ -n "${MIXPREC_GPU_SH_RECIPES:-}" ]; then
  IFS=';' read -ra RECIPES <<< "$MIXPREC_GPU_SH_RECIPES"
fi
NAMES=(env preflight gemm) BOXES=(10 34 25)
for r in "${RECIPES[@]}"; do NAMES+=("bench:$r"); BOXES+=(18); done
NAMES+=(moe:fp8-current moe:mxfp8 grouped tests) BOXES+=(25 25 50 25)
NAMES+=(compile:bf16-master compile:fp8-current compile:moe:fp8-current) BOXES+=(30 30 30)
for i in "${!BOXES[@]}"; do BOXES[i]=$((BOXES[i] * SCALE)); done

if [ "$PLAN_ONLY" = 1 ]; then
  echo "# budget $BUDGET s, summary $SUMMARY s, grace $GRACE s, scale $SCALE"
  for i in "${!NAMES[@]}"; do printf '%s\t%s\n' "${NAMES[i]}" "${BOXES[i]}"; done
  exit 0
fi

if [ "$DRY" = 1 ]; then
  DEV=cpu
  GPT_ARGS=(--size tiny --batch 2 --seq 32 --steps 1 --warmup 0)
  MOE_ARGS=(--model qwen3_moe --hidden 64 --experts 4 --vocab 128 --seq 32 --batch 2
            --steps 1 --warmup 0)
  # the plumbing under aot_eager (dynamo and AOTAutograd), not inductor's C++ builds
  COMPILE_ARGS=(--size tiny --batch 2 --seq 32 --steps 1 --warmup 1
                --compile-backend aot_eager)
  COMPILE_MOE_ARGS=("${MOE_ARGS[@]}" --compile-backend aot_eager)
  GEMM_ARGS=(--shapes 64x96x80,40x200x136 --repeats 1)
  GROUPED_ARGS=(--tokens 64 --experts 4 --k 64 --n 128 --repeats 1
                --formats fp8-current,mxfp8 --timeout 9999)
  PER_TEST=45 PF_TIMEOUT=9999  # a process, per check or case: no limit but the box
else
  DEV=cuda
  GPT_ARGS=(--size large --batch 4 --steps 4 --warmup 1)
  MOE_ARGS=(--model qwen3_moe --hidden 1024 --experts 16 --vocab 4096 --seq 1024
            --batch 8 --steps 4 --warmup 1)
  COMPILE_ARGS=(--size base --batch 16 --steps 4 --warmup 1)
  COMPILE_MOE_ARGS=("${MOE_ARGS[@]}")
  GEMM_ARGS=(--shapes 4096x4096x4096,8192x8192x8192,8192x2048x8192 --repeats 10)
  GROUPED_ARGS=(--tokens 4096 --experts 8,64 --k 2048 --n 4096 --repeats 5 --timeout 25)
  PER_TEST=20 PF_TIMEOUT=25
fi
export PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
KEEP="summary.txt tables.md preflight.jsonl tests.xml tests.log bench.jsonl nvidia-smi.csv rest.tar.gz"
for f in $KEEP; do rm -f "$OUT/$f"; done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mixprec-gpu.XXXXXX")
box_of() { local i; for i in "${!NAMES[@]}"; do [ "${NAMES[i]}" = "$1" ] && echo "${BOXES[i]}"; done; }

# ---- bookkeeping ---------------------------------------------------------------------
now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T0=$(now)
declare -A DONE=()
CUR="" CUR_PID="" CUR_T0="" CUR_LINES="" SAMPLER="" STOP=""
{
  echo "# mixprec benchmarks/gpu.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), device $DEV," \
       "dry run $([ "$DRY" = 1 ] && echo yes || echo no), budget ${BUDGET} s," \
       "${#NAMES[@]} steps"
  printf '# step\texit\twall_s\tnote\n'
} > "$OUT/summary.txt"

record() {  # record NAME EXIT WALL NOTE: one summary line, as the step ends
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/summary.txt"
  DONE[$1]=1
  printf '[%5.0fs] %-28s exit %-5s %6ss  %s\n' "$(since "$T0")" "$1" "$2" "$3" "$4"
}

# what one GPU cannot run, named first so that even an interrupted run says it
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
for what in "tp:tensor parallelism (parallelize_module) over NCCL" \
            "fsdp:FSDP and FSDP x TP over NCCL" "ddp:DDP over NCCL"; do
  printf '%s\tnone\t0\tnot run: needs 2 GPUs (%s; this machine has %s)\n' \
    "${what%%:*}" "${what#*:}" "${GPUS:-0}" >> "$OUT/summary.txt"
done

pack() {  # every other log into rest.tar.gz (written aside, then moved in)
  tar -czf "$WORK.tgz" -C "$WORK" . 2>/dev/null && mv -f "$WORK.tgz" "$OUT/rest.tar.gz"
}

bench_line() {  # bench_line NAME EXIT NOTE [LINES]: the line of a one-recipe step whose
  local r=${1#*:} before=${4:-}  # process wrote none (bench.jsonl had LINES before)
  case $1 in bench:*|moe:*|compile:*) ;; *) return ;; esac
  if [ -n "$before" ] && [ "$(wc -l 2>/dev/null < "$OUT/bench.jsonl" || echo 0)" -gt "$before" ]
  then return; fi
  printf '{"step": "%s", "recipe": "%s", "status": "%s", "error": "%s", "exit": "%s"}\n' \
    "$1" "${r#moe:}" "$([ "$2" = skip ] || [ "$2" = none ] && echo skipped || echo error)" \
    "$3" "$2" >> "$OUT/bench.jsonl"
}

failing() {  # is step $1 named in MIXPREC_GPU_SH_FAIL (itself, or its prefix before ':')
  local e
  IFS=',' read -ra fails <<< "${MIXPREC_GPU_SH_FAIL:-}"
  for e in "${fails[@]}"; do
    [ -n "$e" ] && { [ "$1" = "$e" ] || [ "${1#"$e":}" != "$1" ]; } && return 0
  done
  return 1
}

step() {  # step NAME LOG CMD...: CMD in NAME's time box, output appended to LOG
  local name=$1 log=$2
  shift 2
  local box left lines
  box=$(box_of "$name")
  left=$((BUDGET - SUMMARY - SECONDS - GRACE))
  lines=$(wc -l 2>/dev/null < "$OUT/bench.jsonl" || echo 0)
  if [ "$left" -lt "$box" ]; then box=$left; fi
  if [ "$box" -lt 5 ]; then
    record "$name" skip 0 "skipped: out of time (${left} s left of the ${BUDGET} s run)"
    bench_line "$name" skip "skipped: out of time"
    return
  fi
  if failing "$name"; then  # a forced crash, as a kernel's segfault would be
    set -- "$PY" -c "import ctypes; ctypes.string_at(0)"
  fi
  echo "### $name: $* (box ${box} s)" >> "$log"
  CUR=$name CUR_T0=$(now) CUR_LINES=$lines
  timeout -s INT -k "$GRACE" "$box" "$@" >> "$log" 2>&1 &
  CUR_PID=$!
  if [ "${MIXPREC_GPU_SH_KILL:-}" = "$name" ]; then kill -TERM $$; fi
  wait "$CUR_PID"
  local rc=$? note=""
  case $rc in
    124) note="timed out: SIGINT at the end of its ${box} s box" ;;
    137) note="killed: SIGKILL ${GRACE} s after its ${box} s box" ;;
  esac
  CUR="" CUR_PID=""
  record "$name" "$rc" "$(since "$CUR_T0")" "$note"
  bench_line "$name" "$rc" "exit $rc${note:+, $note}: the process wrote no line" "$lines"
  pack
}

on_signal() {  # the run was told to stop: the step gets SIGINT, the summary says so
  trap '' INT TERM HUP
  STOP="interrupted by SIG$1"
  if [ -n "$CUR_PID" ]; then
    kill -INT "$CUR_PID" 2>/dev/null  # timeout passes it on, then SIGKILLs after GRACE
    wait "$CUR_PID"
    local rc=$?
    record "$CUR" "$rc" "$(since "$CUR_T0")" "interrupted: the script got SIG$1"
    bench_line "$CUR" "$rc" "interrupted: the script got SIG$1" "$CUR_LINES"
  fi
  exit $((128 + $2))
}

finish() {
  local rc=$?
  trap '' INT TERM HUP
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
  local name
  for name in "${NAMES[@]}"; do
    if [ -z "${DONE[$name]:-}" ]; then
      record "$name" none 0 "not run: ${STOP:-the script ended early (exit $rc)}"
      bench_line "$name" none "not run: ${STOP:-the script ended early}"
    fi
  done
  timeout 5 "$PY" benchmarks/gpu_tables.py "$OUT" > "$OUT/tables.md" 2>> "$WORK/tables.err"
  echo "# total $(since "$T0") s; ${STOP:-finished}" >> "$OUT/summary.txt"
  pack
  rm -rf "$WORK" "$WORK.tgz"
  echo "results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  cat "$OUT/summary.txt"
}
trap finish EXIT
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal HUP 1' HUP

# ---- the GPU's own record, every second ----------------------------------------------
if [ "$DRY" != 1 ] && command -v nvidia-smi > /dev/null; then
  fields=timestamp,utilization.gpu,utilization.memory,memory.used,memory.total,power.draw
  fields=$fields,temperature.gpu,clocks.sm,clocks.mem,clocks_throttle_reasons.active
  nvidia-smi --query-gpu="$fields" --format=csv -c 1 > /dev/null 2>&1 \
    || fields=${fields%,clocks_throttle_reasons.active}
  timeout $((BUDGET + 30)) nvidia-smi --query-gpu="$fields" --format=csv -l 1 \
    > "$OUT/nvidia-smi.csv" 2>> "$WORK/nvidia-smi.err" &
  SAMPLER=$!
  mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
else
  echo "# skipped: no nvidia-smi here (dry run, or no NVIDIA driver)" > "$OUT/nvidia-smi.csv"
  mode=""
fi
JOBS=$(( $(nproc) > 3 ? ($(nproc) - 2 < 12 ? $(nproc) - 2 : 12) : 2 ))
case $mode in *Exclusive*) JOBS=1 ;; esac  # one CUDA context at a time

# ---- the steps, in the plan's order ---------------------------------------------------
step env "$WORK/env.txt" bash -c '
  date -u; uname -a; nvidia-smi || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,compute_mode,driver_version,memory.total --format=csv 2>&1
  "$0" -c "import sys, torch, mixprec; print(sys.version); print(\"torch\", torch.__version__,
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA\")"
  "$0" -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|numpy|nvidia-c)" ' "$PY"

PF=$(($(box_of preflight) - 4))  # the preflight's own budget, inside its box
step preflight "$WORK/preflight.log" "$PY" benchmarks/gpu_preflight.py --device "$DEV" \
  --out "$OUT/preflight.jsonl" --budget "$PF" --jobs "$JOBS" \
  --timeout "$((PF_TIMEOUT < PF ? PF_TIMEOUT : PF))"

step gemm "$WORK/gemm.log" "$PY" benchmarks/gpu_gemm.py --device "$DEV" "${GEMM_ARGS[@]}" \
  --out "$OUT/bench.jsonl"

for r in "${RECIPES[@]}"; do
  step "bench:$r" "$WORK/bench-${r//[^A-Za-z0-9._-]/_}.log" "$PY" benchmarks/gpu_bench.py \
    --recipe "$r" --device "$DEV" "${GPT_ARGS[@]}" --out "$OUT/bench.jsonl"
done

for r in fp8-current mxfp8; do
  step "moe:$r" "$WORK/moe-$r.log" "$PY" benchmarks/gpu_bench.py --recipe "$r" \
    --device "$DEV" "${MOE_ARGS[@]}" --out "$OUT/bench.jsonl"
done

step grouped "$WORK/grouped.log" "$PY" benchmarks/gpu_grouped.py --device "$DEV" \
  "${GROUPED_ARGS[@]}" --budget "$(($(box_of grouped) - 3))" --out "$OUT/bench.jsonl"

mapfile -t CUDA_FILES < <(grep -rl --include="test_*.py" "mark\.cuda" tests | sort)
if [ "${#CUDA_FILES[@]}" -gt 0 ]; then
  step tests "$OUT/tests.log" env PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" "$PY" -m pytest \
    -q -rA -m cuda --continue-on-collection-errors -p no:cacheprovider \
    -p pytest_time_box --time-box "$PER_TEST" -o faulthandler_timeout="$((PER_TEST - 5))" \
    --junitxml "$OUT/tests.xml" "${CUDA_FILES[@]}"
else
  record tests none 0 "no CUDA-marked test file found"
fi

for r in bf16-master fp8-current; do
  step "compile:$r" "$WORK/compile-$r.log" "$PY" benchmarks/gpu_bench.py --recipe "$r" \
    --device "$DEV" --compile "${COMPILE_ARGS[@]}" --out "$OUT/bench.jsonl"
done
step compile:moe:fp8-current "$WORK/compile-moe.log" "$PY" benchmarks/gpu_bench.py \
  --recipe fp8-current --device "$DEV" --compile "${COMPILE_MOE_ARGS[@]}" \
  --out "$OUT/bench.jsonl"
