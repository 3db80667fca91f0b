"""Where the workbench trains: under ``--parallel`` with CUDA each rank on its own GPU
(``cuda:LOCAL_RANK``, made current before NCCL starts), the CPU otherwise.

No GPU here: ``torch.cuda``'s answers are monkeypatched to a machine with two, and the
model's and the batches' moves to a CUDA device are recorded and left on the CPU, so the
run itself trains on the CPU over a one-process gloo group."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from mixprec.workbench.model import GPT
from mixprec.workbench.train import TrainConfig, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = TrainConfig(recipe="bf16", size="tiny", batch=2, steps=2, eval_every=2,
                  eval_batches=1, corpus_bytes=300_000)


def _cuda_target(args, kwargs) -> torch.device | None:
    target = args[0] if args else kwargs.get("device")
    if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
        return torch.device(target)
    return None


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two GPUs, as far as the workbench can tell; what it asked for."""
    calls: dict[str, list] = {"set_device": [], "model_to": [], "batch_to": [],
                              "events": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def set_device(d):
        calls["set_device"].append(torch.device("cuda", d) if isinstance(d, int)
                                   else torch.device(d))
        calls["events"].append("set_device")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    module_to, tensor_to = GPT.to, torch.Tensor.to

    def model_to(self, *args, **kwargs):
        dev = _cuda_target(args, kwargs)
        if dev is None:
            return module_to(self, *args, **kwargs)
        calls["model_to"].append(dev)
        return self

    def batch_to(self, *args, **kwargs):
        dev = _cuda_target(args, kwargs)
        if dev is None:
            return tensor_to(self, *args, **kwargs)
        calls["batch_to"].append((dev, self.dtype))
        return self

    monkeypatch.setattr(GPT, "to", model_to)
    monkeypatch.setattr(torch.Tensor, "to", batch_to)
    return calls


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_parallel_run_with_cuda_trains_on_its_local_ranks_gpu(two_gpus, one_rank_group,
                                                                monkeypatch, parallel):
    """Local rank 1 of 2: ``cuda:1``, made current, the model and every batch there."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    res = train(CFG, parallel=parallel, progress=False)
    assert two_gpus["set_device"] == [torch.device("cuda", 1)]
    assert two_gpus["model_to"] == [torch.device("cuda", 1)]
    # 2 training batches and 1 validation batch, inputs and targets each
    assert two_gpus["batch_to"] == [(torch.device("cuda", 1), torch.long)] * 6
    assert res.device == "cuda:1" and len(res.steps) == 2


def test_without_local_rank_the_global_rank_picks_the_gpu(two_gpus, monkeypatch):
    from mixprec.workbench.train import train_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "3")
    assert train_device("ddp") == torch.device("cuda", 1)  # 3 % 2 GPUs


def test_more_ranks_than_gpus_is_refused_naming_both(two_gpus, monkeypatch):
    from mixprec.workbench.train import train_device

    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"cuda:2 .* 2 CUDA device.*--nproc-per-node 2"):
        train_device("ddp")
    assert two_gpus["set_device"] == []


def test_without_parallel_or_with_device_cpu_the_run_stays_on_the_cpu(two_gpus,
                                                                     one_rank_group):
    """The CPU path is unchanged: no CUDA call, nothing moved, even where CUDA exists."""
    single = train(CFG, progress=False)
    on_cpu = train(CFG, parallel="ddp", progress=False, device="cpu")
    assert two_gpus["set_device"] == two_gpus["model_to"] == two_gpus["batch_to"] == []
    assert single.device == on_cpu.device == "cpu"
    assert [s["loss"] for s in single.steps] == [s["loss"] for s in on_cpu.steps]


def test_the_cpu_path_without_cuda(monkeypatch):
    from mixprec.workbench.train import train_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_device("ddp") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device here; use device cpu"):
        train_device("ddp", "cuda")


def _train_args(**kw) -> argparse.Namespace:
    from mixprec.cli.workbench import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args([f"--{k}={v}" if v is not True else f"--{k}"
                         for k, v in kw.items()])


@pytest.mark.parametrize("cuda", [True, False])
def test_the_command_line_binds_nccl_to_the_ranks_gpu(two_gpus, monkeypatch, cuda):
    """``mixprec train --parallel ddp`` under torchrun: with CUDA, ``cuda:LOCAL_RANK`` is
    current before ``init_process_group("nccl", device_id=...)`` and the run trains
    there; without, gloo on the CPU."""
    import mixprec.workbench.train as wb
    from mixprec.cli import workbench as cli

    if not cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    seen = {}

    def init(backend, **kwargs):
        two_gpus["events"].append(f"init {backend}")
        seen["init"] = kwargs

    def fake_train(cfg, out, **kwargs):
        seen["train"] = kwargs
        return wb.TrainResult(cfg)

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(wb, "train", fake_train)
    assert cli.run_train(_train_args(parallel="ddp", steps=1, out="unused")) == 0
    if cuda:
        assert two_gpus["events"] == ["set_device", "init nccl"]  # in that order
        assert seen["init"] == {"device_id": torch.device("cuda", 1)}
        assert seen["train"]["device"] == torch.device("cuda", 1)
    else:
        assert two_gpus["events"] == ["init gloo"] and seen["init"] == {}
        assert seen["train"]["device"] == torch.device("cpu")
