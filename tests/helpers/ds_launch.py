"""Run a training script under DeepSpeed's CPU accelerator with the ranks reducing over
gloo: ``accelerate launch --config_file ds.yaml tests/helpers/ds_launch.py SCRIPT ARGS``.
DeepSpeed's CPU accelerator otherwise compiles its shared-memory allreduce, a C++ op, on
first use (minutes, and a compiler); nothing else of the script's run changes."""

import os
import runpy
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator

import deepspeed.comm.torch  # noqa: E402, F401

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
