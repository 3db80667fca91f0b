"""Run every two-rank example and test script N times and count how each run ended.

    python benchmarks/two_rank_exits.py --runs 30
    python benchmarks/two_rank_exits.py --runs 30 --avx2          # the AVX2 mimic
    python benchmarks/two_rank_exits.py --only fabric,hf_sharded --runs 5 --keep /tmp/logs

A run is clean when it exits 0 and neither rank printed libstdc++'s "terminate called"
(a C++ thread or process group still alive while the interpreter exits aborts the rank
with SIGABRT). Each run starts fresh interpreters with ``OMP_NUM_THREADS=1`` and
``PYTHONFAULTHANDLER=1`` (an aborting rank prints its Python threads' stacks). The
table gives, per program: clean runs, non-zero exits, runs that printed the abort
message, timeouts, and the median seconds per run. ``--keep DIR`` writes the output of
every run that was not clean there, with its core files (after ``ulimit -c
unlimited``); ``--json PATH`` the counts. Nothing is asserted: the counts are the
result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABORT = "terminate called"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]

# the rank functions of tests/helpers/dist_workers.py, as the distributed tests run them,
# started by "spawn": the forkserver's children leave by os._exit and never finalize
SPAWN = """
import sys, tempfile
import torch.multiprocessing as mp
sys.path.insert(0, {tests!r})
from helpers import dist_workers as w
fn = getattr(w, {fn!r})
mp.start_processes(fn, args=(2, tempfile.mkdtemp(), *{args!r}), nprocs=2, join=True,
                   start_method="spawn")  # a full interpreter exit per rank
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _spawn(fn: str, *args) -> list[str]:
    return [sys.executable, "-c", SPAWN.format(tests=str(ROOT / "tests"), fn=fn, args=args)]


def programs(out: str) -> dict[str, list[str]]:
    """Each program's command line; ``out`` is a fresh directory for its files."""
    ex, helpers = ROOT / "examples", ROOT / "tests" / "helpers"
    return {
        "fabric": [sys.executable, str(ex / "fabric_train.py"), "--devices", "2",
                   "--recipe", "fp16-master", "--steps", "6", "--inject-inf", "3:1",
                   "--record", os.path.join(out, "run.json")],
        "lightning": [sys.executable, str(ex / "lightning_train.py"), "--devices", "2",
                      "--recipe", "fp16-master", "--steps", "6", "--inject-inf", "3:1",
                      "--save", os.path.join(out, "last.ckpt")],
        "ddp": [*TORCHRUN, "--master-port", _port(), str(ex / "ddp_train.py"),
                "--recipe", "bf16-master", "--steps", "6"],
        "fsdp": [*TORCHRUN, "--master-port", _port(), str(ex / "ddp_train.py"),
                 "--recipe", "bf16-master", "--parallel", "fsdp", "--steps", "6"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch",
                       "--num_processes", "2", "--cpu", "--main_process_port", _port(),
                       str(ex / "accelerate_train.py"), "--recipe", "fp16-master",
                       "--inject-inf", "3:1", "--out", os.path.join(out, "run.json")],
        "hf_trainer": [*TORCHRUN, "--master-port", _port(), str(ex / "hf_trainer_train.py"),
                       "--steps", "6", "--inject-inf", "3:1", "--out",
                       os.path.join(out, "hf")],
        "hf_sharded": [*TORCHRUN, "--master-port", _port(), str(helpers / "hf_sharded.py"),
                       out],
        "lightning_sharded": [sys.executable, str(helpers / "lightning_sharded.py"), out],
        "gloo_ddp": _spawn("rank_local_inf", "fp16-master", "ddp"),
        "gloo_fsdp": _spawn("gpt_fsdp", "bf16-master", 3),
    }


def run_once(argv: list[str], cwd: str, env: dict, timeout: float) -> tuple[str, float, str]:
    """('clean' | 'exit N' | 'abort' | 'timeout', seconds, output)."""
    t = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace") if isinstance(e.stdout, bytes) else f"{e.stdout}{e.stderr}"
        return "timeout", time.perf_counter() - t, out
    out = p.stdout + p.stderr
    kind = "abort" if ABORT in out else ("clean" if p.returncode == 0
                                         else f"exit {p.returncode}")
    return kind, time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--only", default=None, help="comma-separated program names")
    ap.add_argument("--avx2", action="store_true",
                    help="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (an AVX2 chip)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--keep", default=None, help="directory for the unclean runs' output")
    ap.add_argument("--json", default=None, help="write {program: {outcome: count}} here")
    args = ap.parse_args()
    names = list(programs(tempfile.gettempdir()))
    chosen = args.only.split(",") if args.only else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        ap.error(f"--only {','.join(unknown)}: valid names are {', '.join(names)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    if args.avx2:
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    counts = {n: {} for n in chosen}
    times: dict[str, list[float]] = {n: [] for n in chosen}
    for i in range(args.runs):  # interleaved: a busy spell hits every program alike
        for name in chosen:
            with tempfile.TemporaryDirectory(prefix=f"two-rank-{name}-") as out:
                kind, secs, text = run_once(programs(out)[name], out, env, args.timeout)
                if kind != "clean" and args.keep:  # core files, where the shell allows
                    Path(args.keep).mkdir(parents=True, exist_ok=True)
                    for core in Path(out).glob("core*"):
                        shutil.move(str(core), Path(args.keep, f"{name}-{i}-{core.name}"))
            counts[name][kind] = counts[name].get(kind, 0) + 1
            times[name].append(secs)
            if kind != "clean" and args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                Path(args.keep, f"{name}-{i}-{kind.replace(' ', '')}.log").write_text(text)
            print(f"run {i + 1}/{args.runs} {name}: {kind} ({secs:.1f} s)", flush=True)
    print(f"\n{'program':<18} {'runs':>5} {'clean':>6} {'abort':>6} {'exit!=0':>8} "
          f"{'timeout':>8} {'s/run':>6}")
    for name in chosen:
        c = counts[name]
        bad = sum(v for k, v in c.items() if k.startswith("exit"))
        print(f"{name:<18} {args.runs:>5} {c.get('clean', 0):>6} {c.get('abort', 0):>6} "
              f"{bad:>8} {c.get('timeout', 0):>8} {statistics.median(times[name]):>6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
