"""Data-parallel training with mixprec on torch.distributed.

    torchrun --nproc-per-node 2 examples/ddp_train.py --recipe bf16 --parallel ddp
    torchrun --nproc-per-node 2 examples/ddp_train.py --recipe bf16-master --parallel fsdp

gloo on the CPU, NCCL when CUDA is available. Each rank trains the small workbench GPT
on its own slice of the built-in corpus; rank 0 prints the loss. With ``--checkpoint
PATH`` the run resumes from PATH if it exists and saves there at the end, whole
(``full=True``), so a run can continue on another world size or with the other
``--parallel``.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist

import mixprec
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch

ap = argparse.ArgumentParser()
ap.add_argument("--recipe", default="bf16")
ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--checkpoint", help="resume from this file if it exists; save to it")
args = ap.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = GPT(GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=128)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
net, engine = mixprec.distributed.prepare(model, opt, args.recipe, args.parallel,
                                          max_grad_norm=1.0)
start = 0
if args.checkpoint and os.path.exists(args.checkpoint):
    start = engine.load(args.checkpoint)["step"]
    if rank == 0:
        print(f"resumed at step {start} from {args.checkpoint}")
corpus = load_corpus(max_bytes=1_000_000)
g = torch.Generator().manual_seed(1000 * start + rank)  # each rank its own batches
for step in range(start, start + args.steps):
    x, y = (t.to(device) for t in sample_batch(corpus.train, 8, 128, g))
    with engine.autocast():
        loss = net(x, y)
    engine.backward(loss)
    result = engine.step()
    if rank == 0 and step % 10 == 0:
        print(f"step {step:4d}  loss {loss.item():.4f}  scale {float(result.scale):g}")
if args.checkpoint:
    # every rank calls save: under FSDP full=True gathers the shards, rank 0 writes;
    # under DDP every rank holds the whole state and writes the same file atomically
    engine.save(args.checkpoint, full=True, step=start + args.steps)
# release everything that holds the process group before destroying it, so the group is
# torn down here and not during interpreter exit
del net, engine, model, opt
gc.collect()
dist.destroy_process_group()
