"""The workbench training loop: the small GPT on the built-in corpus under any recipe.

Writes to ``out/``:

- ``metrics.jsonl``: one line per step (loss, scale, skipped, grad norm, tokens/s) and
  one per evaluation (fp32 validation loss);
- ``ckpt.pt``: the last complete checkpoint, written atomically (temp file, fsync,
  rename, fsync of the folder), so a kill at any moment leaves the previous one intact;
- ``config.json``; TensorBoard scalars in ``tb/`` when tensorboard is installed.

``resume=True`` continues from ``ckpt.pt``: model, masters, optimizer, scaler, fp8
histories, the data sampler's RNG and the step counter. The loss trajectory is then
bit-identical to an uninterrupted run on the CPU.

The run trains on ``train_device``'s choice: the CPU, or under ``parallel`` where CUDA
is available this process's GPU (``cuda:LOCAL_RANK``, made the current device, as NCCL
needs); ``device`` picks one. The model is built on the CPU from the seed and moved, and
batches are sampled on the CPU and moved, so a run draws the same data on any device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter  # the step timer (tests replace it with a fake clock)

import torch

from mixprec.checkpoint.core import CheckpointError, load_checkpoint, save_atomic
from mixprec.diagnostics.noise import Agreement, agreement
from mixprec.engine.facade import MixedPrecision
from mixprec.memory import measure
from mixprec.optim import adamw_for
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule, is_schedule_text
from mixprec.workbench.data import load_corpus, sample_batch, val_batches
from mixprec.workbench.model import GPT, SIZES

__all__ = ["TrainConfig", "TrainResult", "train", "train_device", "first_recipe", "CheckpointError",
           "save_atomic"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One workbench run. ``size``: tiny | small | base (see workbench.model.SIZES)."""

    recipe: str = "bf16"
    size: str = "small"
    steps: int = 200
    batch: int = 16
    seq: int | None = None          # default: the size's context length
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 50
    max_grad_norm: float | None = 1.0
    corpus_bytes: int = 2_000_000
    loss_multiplier: float = 1.0    # scenarios: 1e-7 makes fp16 gradients underflow

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size {self.size!r}; valid: {', '.join(SIZES)}")
        first_recipe(self.recipe)  # raises ValueError naming the bad field
        for name in ("steps", "batch", "eval_every", "ckpt_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq is not None and not 1 <= self.seq <= SIZES[self.size].seq_len:
            raise ValueError(f"seq {self.seq} must be in 1..{SIZES[self.size].seq_len} for "
                             f"size {self.size!r}")

    @property
    def seq_len(self) -> int:
        """Tokens per sequence: ``seq``, or the model size's context length."""
        return self.seq or SIZES[self.size].seq_len


@dataclass
class TrainResult:
    """What ``train`` returns: per-step metrics, evaluations, and whether it emulated."""

    config: TrainConfig
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    emulated: bool = False
    device: str = "cpu"  # where it trained (``train_device``)
    kernels: str = ""  # engine.kernels.describe(): the auto choices and measured rates
    memory: dict = field(default_factory=dict)
    fp8_report: str | None = None
    #: the engine's coverage: ``{"low_precision": share, "by_kind": {kind: {fmt: share}}}``
    #: of the parameters that feed matmuls (``engine.coverage``, as the doctor reports it)
    coverage: dict = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float:
        """Validation loss of the last evaluation (NaN if none ran)."""
        return self.evals[-1]["val_loss"] if self.evals else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Median training throughput, leaving out the first fifth of steps (warm-up)."""
        tps = [s["tokens_per_s"] for s in self.steps[len(self.steps) // 5:]]
        return statistics.median(tps) if tps else math.nan

    @property
    def timing(self) -> Agreement:
        """Whether the steps behind ``tokens_per_s`` agree (``diagnostics.noise``): their
        per-step tokens/s, spread and range."""
        tps = [s["tokens_per_s"] for s in self.steps[len(self.steps) // 5:]]
        return agreement(f"{self.config.recipe}'s per-step tokens/s", tps)

    @property
    def skipped(self) -> int:
        """How many steps were skipped for non-finite gradients."""
        return sum(s["skipped"] for s in self.steps)


def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"  # one per process: ranks share out
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"--out {str(out)!r} is not writable ({e.strerror}); choose "
                              "another folder") from None


def _load_checkpoint(path: Path, cfg: TrainConfig) -> dict:
    state = load_checkpoint(path)
    saved = state.get("config", {})
    for key in ("recipe", "size", "batch", "seq", "seed"):
        want = getattr(cfg, key)
        if saved.get(key) != want:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written with {key}={saved.get(key)!r} but "
                f"this run asks for {key}={want!r}; resume with the same settings or use "
                "another --out folder. Nothing was changed")
    return state


def _read_metrics(path: Path, upto_step: int) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a kill: the rest is not trusted
            if rec["step"] <= upto_step:
                out.append(rec)
    return out


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_device(parallel: str | None = None,
                 device: str | torch.device | None = None) -> torch.device:
    """The device a workbench run trains on, made the current CUDA device when a GPU.

    ``device`` None: under ``parallel`` (``ddp`` / ``fsdp``) where CUDA is available, this
    process's GPU, ``cuda:LOCAL_RANK`` (torchrun's numbering on each machine: NCCL needs
    each rank on its own device, current before its first collective); else the CPU.
    ``device`` ``cuda`` without an index means that GPU too (the current one outside
    ``parallel``); ``cpu`` keeps a parallel run on the CPU (gloo)."""
    dev = torch.device(device if device is not None else
                       "cuda" if parallel is not None and torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r}; valid: cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}: no CUDA device here; use device cpu")
    n = torch.cuda.device_count()
    index = (dev.index if dev.index is not None else _local_rank(n) if parallel is not None
             else torch.cuda.current_device())
    if not 0 <= index < n:
        raise ValueError(
            f"cuda:{index} for this process, but this machine has {n} CUDA device(s) "
            f"(cuda:0..cuda:{n - 1}): start at most {n} processes per machine "
            f"(torchrun --nproc-per-node {n}), or pick the device explicitly")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _local_rank(n_devices: int) -> int:
    """This process's rank on its machine: torchrun's ``LOCAL_RANK``; without it, the
    global rank modulo the machine's GPU count."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank % n_devices


def train(cfg: TrainConfig, out: str | Path | None = None, *, resume: bool = False,
          progress: bool | None = None, parallel: str | None = None,
          measure_memory: bool = False, stop_after: int | None = None,
          device: str | torch.device | None = None) -> TrainResult:
    """Train the workbench GPT under ``cfg``; see the module docstring.

    ``stop_after=n`` returns after step n (the schedule still spans ``cfg.steps``), as a
    run that is interrupted and later resumed would. ``device``: see ``train_device``.
    ``progress``: None or True shows it on stderr (a rich bar on a terminal, else a
    line per tenth of the run), False shows nothing.
    """
    out = Path(out) if out is not None else None
    if out is not None:
        _check_out(out)
    dev = train_device(parallel, device)
    rank, ckpt, writes_ckpt = _checkpoint_path(out, parallel, resume)
    state = _load_checkpoint(ckpt, cfg) if resume else None
    corpus = load_corpus(max_bytes=cfg.corpus_bytes, seed=cfg.seed)
    model, opt, engine = _build(cfg, parallel, dev)
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    start = 0
    result = TrainResult(cfg, emulated=engine.emulating, device=str(dev),
                         kernels=engine.kernels.describe(),
                         fp8_report=str(engine.fp8_report) if engine.fp8_report else None,
                         coverage={"low_precision": engine.coverage.low_precision_share,
                                   "by_kind": engine.coverage.by_kind()})
    if state is not None:
        engine.load_state_dict(state["engine"])
        g.set_state(state["data_rng"])
        start = state["step"]
    mf, tb = _open_logs(out if rank == 0 else None, cfg, resume, start, result)
    vals = val_batches(corpus.val, cfg.batch, cfg.seq_len, cfg.eval_batches)
    show = progress is not False and rank == 0
    bar = _Progress(cfg, start, show)
    try:
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        for step in range(start, end):
            lines = [_train_step(cfg, engine, opt, corpus, g, step, dev)]
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                lines.append({"step": step, "val_loss": _evaluate(model, vals, dev)})
                result.evals.append(lines[1])
            result.steps.append(lines[0])
            _log(mf, tb, lines, step)
            bar.update(lines[0], result)
            done = step + 1
            if ckpt is not None and writes_ckpt and (done % cfg.ckpt_every == 0
                                                     or done == cfg.steps):
                save_atomic({"engine": engine.state_dict(), "step": done,
                             "data_rng": g.get_state(),
                             "config": dataclasses.asdict(cfg)}, ckpt)
    finally:
        bar.close()
        for sink in (mf, tb):
            if sink is not None:
                sink.close()
    if measure_memory:
        x, y = sample_batch(corpus.train, cfg.batch, cfg.seq_len,
                            torch.Generator().manual_seed(12345))
        result.memory = measure(model, engine, (x.to(dev), y.to(dev))).items
    return result


def _checkpoint_path(out: Path | None, parallel: str | None, resume: bool):
    """``(rank, checkpoint path or None, whether this rank writes it)``. FSDP state is
    sharded: every rank keeps its own file; otherwise rank 0 writes one."""
    rank = 0
    if parallel is not None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    name = f"ckpt-rank{rank}.pt" if parallel == "fsdp" else "ckpt.pt"
    ckpt = out / name if out is not None else None
    if resume and (ckpt is None or not ckpt.exists()):
        raise CheckpointError(f"--resume: no checkpoint in {str(out)!r} (expected "
                              f"{name}); run without --resume first")
    return rank, ckpt, parallel == "fsdp" or rank == 0


def first_recipe(text: str) -> Recipe:
    """The recipe a run starts in: ``text``'s, or its first phase's where ``text`` is a
    precision schedule (``"nvfp4>bf16-master@0.8"``)."""
    if is_schedule_text(text):
        return PrecisionSchedule.parse(text).recipes[0]
    return Recipe.coerce(text)


def _engine_recipe(cfg: TrainConfig) -> Recipe | PrecisionSchedule:
    """What the engine trains under: the recipe, or the schedule over ``cfg.steps``."""
    if is_schedule_text(cfg.recipe):
        return PrecisionSchedule.parse(cfg.recipe, total_steps=cfg.steps)
    return Recipe.coerce(cfg.recipe)


def _build(cfg: TrainConfig, parallel: str | None, device: torch.device):
    """The seeded GPT on ``device`` (built on the CPU: the same weights anywhere), its
    fused AdamW and the engine under ``cfg.recipe``."""
    mcfg = dataclasses.replace(SIZES[cfg.size], seq_len=cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg).to(device)
    # a recipe's states: rules pick each parameter's state format by its name
    first = first_recipe(cfg.recipe)
    named = first.state_rules
    opt = adamw_for(first, model.named_parameters() if named else model.parameters(),
                    lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, opt, _engine_recipe(cfg),
                                max_grad_norm=cfg.max_grad_norm, parallel=parallel)
    return model, opt, engine


def _open_logs(out: Path | None, cfg: TrainConfig, resume: bool, start: int,
               result: TrainResult):
    """``(metrics.jsonl opened to append, tensorboard writer)``, each None without an
    output folder (or off rank 0). On resume the records up to ``start`` are kept."""
    if out is None:
        return None, None
    metrics_path = out / "metrics.jsonl"
    kept = _read_metrics(metrics_path, start - 1) if resume else []
    result.steps = [r for r in kept if "loss" in r]
    result.evals = [r for r in kept if "val_loss" in r]
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return open(metrics_path, "a"), _tensorboard(out)


def _train_step(cfg: TrainConfig, engine, opt, corpus, g, step: int,
                device: torch.device) -> dict:
    """One optimizer step on a batch sampled on the CPU and moved to ``device``; its
    metrics record (the time waits for a GPU's queued work)."""
    for group in opt.param_groups:  # a tensor lr (torchao, capturable) is set in place
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(_lr_at(cfg, step))
        else:
            group["lr"] = _lr_at(cfg, step)
    x, y = sample_batch(corpus.train, cfg.batch, cfg.seq_len, g)
    x, y = x.to(device), y.to(device)
    t0 = perf_counter()
    with engine.autocast():
        loss = engine.model(x, y)
    engine.backward(loss * cfg.loss_multiplier)
    res = engine.step()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    dt = perf_counter() - t0
    return {"step": step, "loss": loss.item(), "scale": float(res.scale),
            "skipped": bool(res.skipped), "grad_norm": float(res.grad_norm),
            "tokens_per_s": cfg.batch * cfg.seq_len / dt, "lr": _lr_at(cfg, step)}


def _log(mf, tb, lines: list[dict], step: int) -> None:
    """Append the step's records to metrics.jsonl and tensorboard."""
    if mf is not None:
        mf.write("".join(json.dumps(r) + "\n" for r in lines))
        mf.flush()
    if tb is not None:
        tb.add_scalar("loss/train", lines[0]["loss"], step)
        tb.add_scalar("loss_scale", lines[0]["scale"], step)
        if len(lines) > 1:
            tb.add_scalar("loss/val", lines[1]["val_loss"], step)


@torch.no_grad()
def _evaluate(model, batches, device: torch.device) -> float:
    """Validation loss in fp32 (the model's own dtype for -master recipes is upcast)."""
    was = model.training
    model.eval()
    try:
        losses = []
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast(x.device.type, enabled=False):
                logits = model(x)
            losses.append(torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), y.flatten()).item())
        return sum(losses) / len(losses)
    finally:
        model.train(was)


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        return None
    return SummaryWriter(str(out / "tb"))


class _Progress:
    """Where the run is, on stderr: on a terminal a rich bar with loss, tokens/s, loss
    scale and skipped steps; elsewhere (a pipe, a log file, CI) the same figures as one
    plain line per step-group (a tenth of the run), so a run that is not watched on a
    terminal still shows it is alive. ``show`` False: nothing."""

    def __init__(self, cfg: TrainConfig, start: int, show: bool) -> None:
        self.bar = None
        self.cfg, self.every = cfg, max(1, -(-cfg.steps // 10))
        self.lines = show and not sys.stderr.isatty()
        if not show or self.lines:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:  # the library without its cli extra: plain lines instead
            self.lines = True
            return

        self.bar = Progress(TextColumn(f"[bold]{cfg.recipe}[/]"), BarColumn(),
                            TextColumn("{task.completed}/{task.total}"),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                            console=Console(stderr=True))
        self.bar.start()
        self.task = self.bar.add_task("train", total=cfg.steps, completed=start, info="")

    def update(self, rec: dict, result: TrainResult) -> None:
        info = (f"loss {rec['loss']:.3f}  {rec['tokens_per_s']:,.0f} tok/s  "
                f"scale {rec['scale']:g}  skipped {result.skipped}")
        done = rec["step"] + 1
        if self.lines and (done % self.every == 0 or done == self.cfg.steps):
            print(f"{self.cfg.recipe}: step {done}/{self.cfg.steps}  {info}",
                  file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
