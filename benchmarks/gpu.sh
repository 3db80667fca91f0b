#!/usr/bin/env bash
# One-shot run on a lent NVIDIA H100/H200, in at most 7 minutes (a second run fits in
# one 10-minute call of the device tool), that cannot lose its results:
#   bash benchmarks/gpu.sh              # results in $OUT (or ./gpu-results)
#   bash benchmarks/gpu.sh --dry-run    # the same steps on a CPU, tiny sizes
#                                       # (also MIXPREC_GPU_SH_DRY_RUN=1)
# Steps, in this order, each in its own time box (SIGINT at the box's end, so pytest and
# the Python steps write what they have; SIGKILL 5 s later), all within the 7 minutes
# (a step that no longer fits is recorded as skipped):
#   env        nvidia-smi, versions (rest.tar.gz: env.txt)
#   preflight  benchmarks/gpu_preflight.py: each kernel check in its own process
#   tests      the CUDA-marked tests (-m cuda), one time box per test, JUnit XML
#   compile    the CUDA compile test, last of the tests
#   grouped    benchmarks/grouped_gemm.py: the experts' grouped GEMM per format and
#              route (bf16 torch._grouped_mm, loop, grouped, scaled_grouped), each
#              checked against the loop route, one JSON line per case in bench.jsonl
#   bench:R    benchmarks/gpu_bench.py: one process per recipe R, one JSON line each,
#              fast recipes first, the dequantizing ones (fp8-block, mxfp8, nvfp4) last
#   plan       benchmarks/plan.py: the planner's predictions against measurement
# Files in $OUT, 8 at most: summary.txt (each step's exit code and wall time, written as
# each ends), preflight.jsonl, tests.xml, tests.log, bench.jsonl, plan.txt,
# nvidia-smi.csv (sampled every second), rest.tar.gz (every other log, repacked after
# each step). On SIGTERM/SIGINT/SIGHUP the running step gets SIGINT and summary.txt
# names what did not run.
# Environment: PY (python3), OUT; MIXPREC_GPU_SH_RECIPES="a;b" runs these recipes;
# for tests of this script: MIXPREC_GPU_SH_FAIL=step[,step] crashes those steps
# (SIGSEGV; "bench" covers every bench:R), MIXPREC_GPU_SH_KILL=step sends this script
# SIGTERM as that step starts.
set -uo pipefail
export LC_ALL=C
cd "$(dirname "$0")/.."

DRY=${MIXPREC_GPU_SH_DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg'; valid: --dry-run, --help" >&2; exit 2 ;;
  esac
done
PY=${PY:-python3}
OUT=${OUT:-gpu-results}
BUDGET=420   # seconds for the whole run, summary and packing included
GRACE=5      # seconds between a step's SIGINT and its SIGKILL
export PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
KEEP="summary.txt preflight.jsonl tests.xml tests.log bench.jsonl plan.txt nvidia-smi.csv rest.tar.gz"
for f in $KEEP; do rm -f "$OUT/$f"; done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mixprec-gpu.XXXXXX")

if [ "$DRY" = 1 ]; then
  DEV=cpu
  BENCH_ARGS=(--device cpu --size tiny --batch 2 --seq 32 --steps 1 --warmup 0)
  PLAN_ARGS=(--device cpu --models gpt --size tiny --batch 2 --steps 1 --seconds 0.02)
  GROUPED_ARGS=(--device cpu --tokens 64 --experts 4 --k 64 --n 128 --repeats 1)
  TEST_BOX=60 COMPILE_BOX=60 PER_TEST=45 PLAN_BOX=30 RECIPE_BOX=60 GROUPED_BOX=60
else
  DEV=cuda
  BENCH_ARGS=(--device cuda --size large --batch 4 --steps 4 --warmup 1)
  PLAN_ARGS=(--device cuda --models gpt --size medium --batch 32 --steps 5)
  GROUPED_ARGS=(--device cuda --tokens 4096 --experts 8,64 --k 2048 --n 4096 --repeats 5)
  TEST_BOX=75 COMPILE_BOX=60 PER_TEST=45 PLAN_BOX=60 RECIPE_BOX= GROUPED_BOX=45
fi

# ---- the plan: step names and boxes, in order ------------------------------------
NAMES=(env preflight tests compile grouped)
BOXES=(15 60 "$TEST_BOX" "$COMPILE_BOX" "$GROUPED_BOX")
declare -A RECIPE_OF=()
RECIPES=()
listed=$("$PY" benchmarks/gpu_bench.py --list 2>"$WORK/recipes.err")
declare -A LISTED_BOX=()
while IFS=$'\t' read -r r box; do
  [ -n "$r" ] && LISTED_BOX[$r]=$box
done <<< "$listed"
if [ -n "${MIXPREC_GPU_SH_RECIPES:-}" ]; then
  IFS=';' read -ra RECIPES <<< "$MIXPREC_GPU_SH_RECIPES"
else
  mapfile -t RECIPES < <(cut -f1 <<< "$listed" | sed '/^$/d')
fi
for r in "${RECIPES[@]}"; do
  NAMES+=("bench:$r")
  BOXES+=("${RECIPE_BOX:-${LISTED_BOX[$r]:-45}}")
  RECIPE_OF[bench:$r]=$r
done
NAMES+=(plan)
BOXES+=("$PLAN_BOX")

# ---- bookkeeping ---------------------------------------------------------------------
now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T0=$(now)
declare -A DONE=()
CUR="" CUR_PID="" CUR_T0="" CUR_BOX="" SAMPLER="" STOP=""
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

pack() {  # every other log into rest.tar.gz (written aside, then moved in)
  tar -czf "$WORK.tgz" -C "$WORK" . 2>/dev/null && mv -f "$WORK.tgz" "$OUT/rest.tar.gz"
}

bench_line() {  # bench_line NAME EXIT NOTE [LINES]: a recipe's line where its process
  local r=${RECIPE_OF[$1]:-} before=${4:-}  # wrote none (bench.jsonl had LINES before)
  [ -z "$r" ] && return
  if [ -n "$before" ] && [ "$(wc -l 2>/dev/null < "$OUT/bench.jsonl" || echo 0)" -gt "$before" ]
  then return; fi
  printf '{"recipe": "%s", "status": "%s", "error": "%s", "exit": "%s"}\n' \
    "$r" "$([ "$2" = skip ] || [ "$2" = none ] && echo skipped || echo error)" \
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

step() {  # step INDEX LOG CMD...: CMD in its time box, output appended to LOG
  local i=$1 log=$2
  shift 2
  local name=${NAMES[$i]} box=${BOXES[$i]}
  local left=$((BUDGET - 5 - SECONDS - GRACE))
  local lines
  lines=$(wc -l 2>/dev/null < "$OUT/bench.jsonl" || echo 0)
  if [ "$left" -lt "$box" ]; then box=$left; fi
  if [ "$box" -lt 10 ]; then
    record "$name" skip 0 "skipped: out of time (${left} s left of the ${BUDGET} s run)"
    bench_line "$name" skip "skipped: out of time"
    return
  fi
  if failing "$name"; then  # a forced crash, as a kernel's segfault would be
    set -- "$PY" -c "import ctypes; ctypes.string_at(0)"
  fi
  echo "### $name: $* (box ${box} s)" >> "$log"
  CUR=$name CUR_T0=$(now) CUR_BOX=$box CUR_LINES=$lines
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

# ---- the steps -------------------------------------------------------------------------
step 0 "$WORK/env.txt" bash -c '
  date -u; uname -a; nvidia-smi || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,compute_mode,driver_version,memory.total --format=csv 2>&1
  "$0" -c "import sys, torch, mixprec; print(sys.version); print(\"torch\", torch.__version__,
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA\")"
  "$0" -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|numpy|nvidia-c)" ' "$PY"

PF_BUDGET=52
step 1 "$WORK/preflight.log" "$PY" benchmarks/gpu_preflight.py --device "$DEV" \
  --out "$OUT/preflight.jsonl" --budget "$PF_BUDGET" --jobs "$JOBS" \
  --timeout "$([ "$DRY" = 1 ] && echo $PF_BUDGET || echo 30)"

mapfile -t CUDA_FILES < <(grep -l "mark\.cuda" tests/test_*.py)
PYTEST=(env PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" "$PY" -m pytest -q -rA -m cuda
        --continue-on-collection-errors
        -p no:cacheprovider -p pytest_time_box --time-box "$PER_TEST"
        -o faulthandler_timeout="$((PER_TEST - 5))")
if [ "${#CUDA_FILES[@]}" -gt 0 ]; then
  step 2 "$OUT/tests.log" "${PYTEST[@]}" -k "not compile" --junitxml "$OUT/tests.xml" \
    "${CUDA_FILES[@]}"
  step 3 "$OUT/tests.log" "${PYTEST[@]}" -k compile --junitxml "$WORK/compile.xml" \
    "${CUDA_FILES[@]}"
else
  record tests none 0 "no CUDA-marked test file found"
  record compile none 0 "no CUDA-marked test file found"
fi

step 4 "$WORK/grouped.log" "$PY" benchmarks/grouped_gemm.py "${GROUPED_ARGS[@]}" \
  --out "$OUT/bench.jsonl"

i=5
for r in "${RECIPES[@]}"; do
  step "$i" "$WORK/bench-${r//[^A-Za-z0-9._-]/_}.log" "$PY" benchmarks/gpu_bench.py \
    --recipe "$r" "${BENCH_ARGS[@]}" --out "$OUT/bench.jsonl"
  i=$((i + 1))
done

step "$i" "$OUT/plan.txt" "$PY" benchmarks/plan.py "${PLAN_ARGS[@]}"
