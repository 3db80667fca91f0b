"""Launching examples on two processes: a free rendezvous port and the ranks' records."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

__all__ = ["free_port", "two_rank_records"]


def free_port() -> int:
    """A TCP port nothing listens on now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_records(argv: list[str], record, cwd) -> tuple[dict, dict]:
    """Run an example that trains on 2 processes and writes each rank's JSON record to
    ``record`` (rank 0) and ``record.rank1``; returns both records. The run must succeed
    and both ranks must have seen a world of 2, with the engine's DDP."""
    run = subprocess.run(argv, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = (json.loads(Path(p).read_text()) for p in (record, f"{record}.rank1"))
    assert r0["world"] == r1["world"] == 2
    return r0, r1
