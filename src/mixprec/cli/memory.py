"""``mixprec memory``: the planner's tables and a stacked-bar plot (matplotlib, lazily)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.memory import GB, ITEMS, Breakdown, TransformerSpec, estimate, stage_estimates
from mixprec.memory import parse_bytes as parse
from mixprec.memory.hf_config import spec_from_config
from mixprec.memory.pipeline import SCHEDULES, PipelineSchedule, in_flight
from mixprec.memory.shapes import param_count

__all__ = ["add_arguments", "run", "plot_breakdowns", "parse_bytes"]


def parse_bytes(text: str) -> float:
    """``80GB``, ``80G``, ``141e9``, ``24GiB`` -> bytes (``mixprec.memory.parse_bytes``)."""
    return parse(text, "--device-memory")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec memory``."""
    p.add_argument("--params", help="parameter count, e.g. 70B, 7.5e9, 350M (default: "
                                    "counted from --config or the shape options)")
    p.add_argument("--config", help="a transformers config.json (or its folder): the "
                                    "model's shapes, grouped-query attention, SwiGLU and "
                                    "experts included; needs --seq")
    p.add_argument("--recipe", default="fp32,bf16-master,fp16-master",
                   help="presets to compare, comma-separated; recipes with overrides are "
                        "separated by ';', e.g. 'fp32;fp16-master,grads=fp16'")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw, adam, sgd_momentum, sgd, adagrad, rmsprop, adadelta, adamax, "
                        "nadam, radam")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (FSDP = 3)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel ranks to shard over")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, default=1, help="micro-batch per rank")
    p.add_argument("--vocab", type=int)
    p.add_argument("--kv-heads", type=int, help="K and V heads (grouped-query attention; "
                                                "default --heads)")
    p.add_argument("--head-dim", type=int, help="each head's width (default hidden/heads)")
    p.add_argument("--ffn-hidden", type=int,
                   help="the MLP's width (intermediate_size; default 4 x --hidden)")
    p.add_argument("--swiglu", action="store_true",
                   help="gated MLPs (gate, up and down Linears: Llama, Mixtral, Qwen)")
    p.add_argument("--experts", type=int, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, help="experts per token (default 1)")
    p.add_argument("--expert-ffn-hidden", type=int,
                   help="each expert's width (moe_intermediate_size; default --ffn-hidden)")
    p.add_argument("--shared-ffn-hidden", type=int,
                   help="width of the shared experts beside the routed ones (0: none)")
    p.add_argument("--dense-layers", type=int,
                   help="layers with a dense MLP instead of experts")
    p.add_argument("--untied", action="store_true",
                   help="the head has its own matrix (not tied to the embedding)")
    p.add_argument("--rms-norm", action="store_true",
                   help="transformers' RMSNorm, not LayerNorm: a weight only, and fp32 "
                        "input and normalized values saved")
    p.add_argument("--attention", choices=["materialized", "flash"], default="flash")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: price each stage's layers, micro-batches in "
                        "flight and boundary buffers, and report the worst (needs the "
                        "shapes: --config or --layers/--hidden/--heads/--seq)")
    p.add_argument("--microbatches", type=int,
                   help="micro-batches per step under --pp (default: --pp)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                   help="the pipeline schedule under --pp (torch's ScheduleGPipe, "
                        "Schedule1F1B, ScheduleInterleaved1F1B)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="stages per rank under --schedule interleaved-1f1b")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: the routed experts' weights and states "
                        "divided over them, plus the dispatch and combine buffers")
    p.add_argument("--device-memory", help="capacity per device, e.g. 80GB: says what fits")
    p.add_argument("--plot", help="write a stacked bar chart comparing the recipes (.png/.svg)")


def _pipeline(args: argparse.Namespace) -> PipelineSchedule | None:
    """The ``--pp`` options' schedule (None: no pipeline)."""
    if args.pp == 1 and args.virtual_stages == 1 and args.microbatches is None:
        return None
    return PipelineSchedule(stages=args.pp, microbatches=args.microbatches or args.pp,
                            schedule=args.schedule, virtual=args.virtual_stages)


def _recipes(text: str) -> list[str]:
    """``a;b`` -> two recipes; ``fp32,bf16`` (presets only) -> two; ``fp16,init_scale=8``
    (a fragment with ``=`` and no ``;``) -> one recipe with overrides."""
    if ";" in text or "=" in text:
        return [r.strip() for r in text.split(";") if r.strip()]
    return [r.strip() for r in text.split(",") if r.strip()]


def run(args: argparse.Namespace) -> int:
    """``mixprec memory``: the byte table per recipe, predicted (and measured on request)."""
    from rich.console import Console
    from rich.table import Table

    spec = _spec(args)
    if args.params is None and spec is None:
        raise ValueError("mixprec memory needs --params (e.g. 70B), --config with --seq, "
                         "or the shape options --layers, --hidden, --heads, --seq")
    params = args.params or param_count(spec)
    pipe = _pipeline(args)
    if pipe is not None:
        if spec is None or args.params:
            raise ValueError("--pp prices the stages of a model's shapes: pass the spec as "
                             "params, i.e. --config with --seq or --layers, --hidden, "
                             "--heads, --seq (without --params)")
        params = spec
    results = {r: estimate(params, r, optimizer=args.optimizer, zero_stage=args.zero,
                           world_size=args.gpus, activations=spec, pipeline=pipe,
                           expert_parallel=args.ep)
               for r in _recipes(args.recipe)}
    cap = parse_bytes(args.device_memory) if args.device_memory else None
    shown = args.params or f"{param_count(spec) / 1e9:.2f}B (counted from the shapes)"
    title = (f"{shown} parameters, {args.optimizer}, ZeRO-{args.zero} over "
             f"{args.gpus} rank(s): GB (1e9 bytes) per rank")
    if pipe is not None:
        title += (f", the worst of {pipe.stages} pipeline stages ({pipe.schedule}, "
                  f"{pipe.microbatches} micro-batches)")
    if args.ep > 1:
        title += f", experts over {args.ep} ranks"
    t = Table(title=title)
    t.add_column("item")
    for r in results:
        t.add_column(r, justify="right")
    used = [k for k in ITEMS if any(b[k] for b in results.values())]
    for k in used:
        t.add_row(k, *(f"{b[k] / GB:,.2f}" for b in results.values()))
    t.add_row("[bold]total[/bold]", *(f"[bold]{b.total / GB:,.2f}[/bold]"
                                      for b in results.values()))
    if any(b.peak is not None for b in results.values()):
        t.add_row("[bold]peak (step)[/bold]", *(
            f"[bold]{b.peak / GB:,.2f}[/bold]" if b.peak is not None else "-"
            for b in results.values()))
    if cap:  # the peak where it is known: a step must fit, not only its steady state
        t.add_row(f"fits {cap / GB:g} GB?", *(
            "yes" if (b.peak if b.peak is not None else b.total) <= cap else "[red]no[/red]"
            for b in results.values()))
    con = Console(width=160)
    con.print(t)
    for n in dict.fromkeys(n for b in results.values() for n in b.notes):  # each once
        con.print(f"note: {n}")
    if pipe is not None:
        for r in results:
            each = stage_estimates(spec, r, pipe, optimizer=args.optimizer,
                                   zero_stage=args.zero, world_size=args.gpus,
                                   expert_parallel=args.ep)
            con.print(f"stages ({r}): peak GB " + ", ".join(
                f"{b.peak / GB:,.3f}" for b in each) + "; micro-batches in flight "
                + ", ".join(f"{in_flight(pipe, i):g}" for i in range(pipe.stages)))
    if args.plot:
        out = plot_breakdowns(results, args.plot, title=title, capacity=cap)
        con.print(f"plot written to {out}")
    return 0


#: the shape options (``--kv-heads`` sets ``kv_heads``): TransformerSpec fields
_SHAPE = ("layers", "hidden", "heads", "vocab", "kv_heads", "head_dim", "ffn_hidden",
          "experts", "top_k", "expert_ffn_hidden", "shared_ffn_hidden", "dense_layers")


def _spec(args: argparse.Namespace) -> TransformerSpec | None:
    """The model's shapes: ``--config``'s (the shape options given override it), or the
    shape options' (all of --layers, --hidden, --heads, --seq), or None."""
    run = {"micro_batch": args.batch, "attention": args.attention,
           "recompute": args.recompute, "dropout": False}
    given = {f: getattr(args, f) for f in _SHAPE if getattr(args, f) is not None}
    flags = {"gated": (args.swiglu, True), "tied_embeddings": (args.untied, False),
             "norm": (args.rms_norm, "rms")}
    given.update({f: v for f, (on, v) in flags.items() if on})
    if args.config:
        if args.seq is None:
            raise ValueError("--config needs --seq: the tokens per sequence the "
                             "activations are priced at")
        return spec_from_config(args.config, args.seq, **run, **given)
    if not given and args.seq is None:
        return None
    if not all(v is not None for v in (args.layers, args.hidden, args.heads, args.seq)):
        raise ValueError("the shape options need all of --layers, --hidden, --heads, "
                         "--seq (or --config and --seq)")
    return TransformerSpec(seq_len=args.seq, **run, **given)


def plot_breakdowns(results: dict[str, Breakdown], path: str | Path, *, title: str = "",
                    capacity: float | None = None) -> Path:
    """A stacked bar per recipe, one colour per item, GB on the y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"--plot {str(path)!r}: use a .png or .svg file name")
    if not path.parent.exists():
        raise FileNotFoundError(f"--plot: folder {str(path.parent)!r} does not exist")
    used = [k for k in ITEMS if any(b[k] for b in results.values())]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(results), 4.8), dpi=120)
    names = list(results)
    labels = [n.replace(",", ",\n") for n in names]  # long recipe strings wrap
    bottom = [0.0] * len(names)
    colors = plt.get_cmap("tab10").colors
    for i, k in enumerate(used):
        vals = [results[n][k] / GB for n in names]
        ax.bar(labels, vals, bottom=bottom, label=k, color=colors[i % 10], width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:,.0f}" if total >= 10 else f"{total:.2f}", ha="center",
                va="bottom", fontsize=9)
    if capacity:
        ax.axhline(capacity / GB, color="black", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, capacity / GB, f" device {capacity / GB:g} GB", va="bottom",
                ha="right", fontsize=8)
    ax.set_ylabel("GB per rank (1e9 bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
