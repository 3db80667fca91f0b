"""A two-rank gloo program whose last collective's Python callback is still on a gloo
thread when the main thread returns, for tests/parallel/test_two_rank_exit.py:

    python tests/helpers/exit_workers.py

Ranks start with the ``spawn`` method, so each ends with a full interpreter exit (the
forkserver's children leave by ``os._exit`` and never finalize). The callback is handed
over through the comm hook's tracker (``mixprec.parallel.comm``), which the exit waits on."""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixprec.parallel import comm


def rank_main(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)

    def slow(f):
        time.sleep(0.3)  # the main thread is past its last line by now
        return f.value()[0]

    dist.all_reduce(torch.ones(4), async_op=True).get_future().then(comm._HANDED.track(slow))


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(2, tempfile.mkdtemp()), nprocs=2, join=True,
                       start_method="spawn")
