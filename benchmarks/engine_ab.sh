#!/usr/bin/env bash
# The engine's overhead before and after a change, on this machine, runs alternating:
#
#   bash benchmarks/engine_ab.sh OLD_REV [ROUNDS] [-- benchmarks/engine.py arguments]
#
# Checks OLD_REV out into a temporary worktree and runs this tree's
# benchmarks/engine.py --control against OLD_REV's library and then against this
# tree's, ROUNDS times (default 3), alternating, so that a drift of the shared host
# hits both. Prints each run's overhead and control lines. Default model: the
# workbench's medium GPT (4 layers, d=256, batch 8x128), where the engine's Python
# work weighs the most.
set -euo pipefail
old=${1:?usage: engine_ab.sh OLD_REV [ROUNDS] [-- engine.py args]}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
[ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--layers 4 --d-model 256 --heads 4 --batch 8 --seq 128 --steps 12)
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
wt=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git -C "$root" worktree add -q --detach "$wt" "$old"
for i in $(seq "$rounds"); do
  for side in old new; do
    src=$root/src
    [ "$side" = old ] && src=$wt/src
    echo "== round $i, $side ($([ "$side" = old ] && echo "$old" || git -C "$root" rev-parse --short HEAD))"
    PYTHONPATH=$src "$py" "$root/benchmarks/engine.py" --control "${args[@]}" \
      | grep -E "^# GPT|overhead vs|control,"
  done
done
