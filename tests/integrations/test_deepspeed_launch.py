"""``accelerate launch --config_file ds.yaml`` with ``distributed_type: DEEPSPEED`` and
a ``deepspeed_config_file`` (ZeRO-3, bf16) of examples/accelerate_train.py under
``fp8-current``: two CPU processes (DeepSpeed's CPU accelerator, gloo) train on their
own shards, end with the same fp32 masters, and report the coverage with the Linears in
fp8-current. The launch runs the example through tests/helpers/ds_launch.py (the ranks
reduce over gloo instead of DeepSpeed's compiled shared-memory op)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import free_port
from helpers.paths import ROOT

DS_CONFIG = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
             "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}

YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: false
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: {port}
"""


@pytest.mark.long
def test_accelerate_launch_of_a_deepspeed_yaml_trains_the_linears_in_fp8(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    yaml = tmp_path / "ds.yaml"
    yaml.write_text(YAML.format(config=config, port=free_port()))
    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml),
         str(ROOT / "tests" / "helpers" / "ds_launch.py"),
         str(ROOT / "examples" / "accelerate_train.py"), "--recipe", "fp8-current",
         "--steps", "6", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r0, r1 = (json.loads(Path(p).read_text()) for p in (out, f"{out}.rank1"))
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["world"] == r1["world"] == 2
    assert r0["steps"] == r1["steps"] == 6 and not any(r0["skipped"] + r1["skipped"])
    # each rank its own shard of the batches, one update: the same masters
    assert r0["losses"] != r1["losses"] and r0["weights"] == r1["weights"]
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert mean[-1] < mean[0] - 0.5
    blocks = {n: f for n, f in r0["coverage"].items() if n.startswith("blocks.")}
    assert len(blocks) == 8 and set(blocks.values()) == {"fp8-current"}
    assert r0["coverage"]["head"] == "bf16"  # tied to the embedding: kept
    assert r0["low_precision_share"] == pytest.approx(6 / 7)
    assert "86% below 16 bits (fp8-current)" in run.stdout
    assert "ZeRO-3, bf16" in run.stderr  # the hand-over, said once per rank
