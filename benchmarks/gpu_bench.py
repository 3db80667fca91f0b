"""One recipe's training step in its own process, as one JSON line.

    python benchmarks/gpu_bench.py --recipe fp8-current --device cuda --size large \\
        --batch 4 --steps 4 --warmup 1 --out gpu-results/bench.jsonl
    python benchmarks/gpu_bench.py --recipe mxfp8 --model qwen3_moe --device cuda
    python benchmarks/gpu_bench.py --recipe bf16-master --compile --size base ...

``benchmarks/gpu.sh`` runs one process per recipe, each in its own time box, so an
out-of-memory error or a crash costs that recipe's line only.

- ``--model gpt`` (default): ``mixprec bench`` on the workbench GPT. The line holds the
  bench's row (step time, tokens/s, MFU against the peak the bench measures for the
  recipe's route, the allocator's peak, the route each fp8 Linear took, the engine's
  kernel choices); with ``--compile`` also the compiled step, interleaved with eager.
- ``--model qwen3_moe``: transformers' Qwen3-MoE causal LM built from a config
  (``--hidden``, ``--experts``; nothing downloaded) under the engine: its experts run
  mixprec's grouped GEMM in the recipe's format. The line holds the median step, the
  tokens/s, the loss, the experts' formats, and with ``--compile`` the step of the
  model under ``torch.compile``.

Every warning raised is in the line, the fp8 route probe's among them. A recipe that
raises, or is interrupted (SIGINT or SIGTERM at the end of its box), still writes its
line: ``status`` ``error`` with the exception. The line is appended to ``--out`` in
one write (and printed).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import statistics
import sys
import time
import traceback
import warnings


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _probe_route(recipe: str, device: str) -> str | None:
    """The GEMM route an fp8 recipe's Linears take on ``device`` (this runs the
    block-scaled probe under ``fp8_gemm=auto``, so its warnings are caught here)."""
    from mixprec.recipe import Recipe

    fmt = Recipe.coerce(recipe).linear
    return None if fmt is None else fmt.route(device)


def _qwen3_moe(args: argparse.Namespace, device: str):
    """A Qwen3-MoE causal LM from a config (2 layers, ``args.hidden`` wide,
    ``args.experts`` experts, top-2, head 64) in fp32 on ``device``, and its batch."""
    import torch
    import transformers

    h = args.hidden
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=h, intermediate_size=2 * h,
        moe_intermediate_size=h, num_hidden_layers=2, num_attention_heads=max(1, h // 64),
        num_key_value_heads=max(1, h // 128), head_dim=min(64, h), num_experts=args.experts,
        num_experts_per_tok=2, max_position_embeddings=args.seq or 512,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq or 512), generator=g).to(device)
    return model, {"input_ids": ids, "labels": ids}


def moe_row(args: argparse.Namespace) -> dict:
    """The Qwen3-MoE model's training step under ``args.recipe`` through the engine
    (and, with ``args.compile``, the same model compiled, interleaved)."""
    import torch

    from mixprec import MixedPrecision
    from mixprec.experts import experts_formats
    from mixprec.optim import adamw_for

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model, batch = _qwen3_moe(args, args.device)
    e = MixedPrecision(model, adamw_for(args.recipe, model.parameters()), args.recipe)
    loops = {"eager": model}
    if args.compile:
        loops["compiled"] = torch.compile(model)
    times: dict[str, list[float]] = {k: [] for k in loops}
    losses = []
    for i in range(args.warmup + args.steps):
        for k, f in loops.items():
            sync()
            t = time.perf_counter()
            with e.autocast():
                loss = f(**batch).loss
            e.backward(loss)
            e.step()
            sync()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t)
            losses.append(loss.item())
    formats: dict[str, int] = {}
    for fmt in experts_formats(model).values():
        formats[str(fmt.fp8_recipe)] = formats.get(str(fmt.fp8_recipe), 0) + 1
    tokens = batch["input_ids"].numel()
    med = statistics.median(times["eager"])
    row = {"model": "qwen3_moe", "hidden": args.hidden, "experts": args.experts,
           "step_ms": med * 1e3, "tokens_per_s": tokens / med, "losses": losses,
           "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
           "experts_formats": formats, "kernels": e.kernels.describe(),
           "max_memory_allocated": (torch.cuda.max_memory_allocated(dev)
                                    if dev.type == "cuda" else None)}
    if args.compile:
        row["compiled_step_ms"] = statistics.median(times["compiled"]) * 1e3
    return row


def run_one(args: argparse.Namespace) -> dict:
    """The line for ``args.recipe``: the bench row with the run's settings, or the
    error; with the warnings raised and the wall time."""
    t0 = time.perf_counter()
    line = {"recipe": args.recipe, "status": "error", "model": args.model,
            "device": args.device, "compile": args.compile,
            "compile_backend": args.compile_backend, "size": args.size,
            "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch

            from mixprec.workbench.bench import bench

            line["torch"] = torch.__version__
            if args.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("--device cuda: no CUDA device here")
            line["probe_route"] = _probe_route(args.recipe, args.device)
            if args.model == "qwen3_moe":
                line.update(moe_row(args), status="ok")
            else:
                result = bench([args.recipe], size=args.size, batch=args.batch,
                               seq=args.seq, steps=args.steps, warmup=args.warmup,
                               device=args.device, compile=args.compile)
                line.update(result["rows"][0], status="ok", seq=result["seq"],
                            flops_per_step=result["flops_per_step"])
                line.pop("speedup_vs_fp32", None)  # one recipe: no fp32 row to compare
        except KeyboardInterrupt as e:
            line["error"] = f"interrupted ({e or 'SIGINT'}): the recipe's time box ended"
        except BaseException as e:  # whatever it is, the line is written
            line["error"] = f"{type(e).__name__}: {e}"[:2000]
            line["traceback"] = traceback.format_exc()[-3000:]
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"[:500]
        if text not in seen:
            seen.append(text)
    line["warnings"] = seen[:20]
    line["wall_s"] = round(time.perf_counter() - t0, 2)
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--model", default="gpt", choices=["gpt", "qwen3_moe"])
    ap.add_argument("--compile", action="store_true",
                    help="also time the model under torch.compile, interleaved with eager")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile's backend (default inductor; the dry run's "
                         "aot_eager traces without building kernels)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="large", help="the workbench GPT's size")
    ap.add_argument("--hidden", type=int, default=1024, help="Qwen3-MoE's hidden size")
    ap.add_argument("--experts", type=int, default=16, help="Qwen3-MoE's expert count")
    ap.add_argument("--vocab", type=int, default=4096, help="Qwen3-MoE's vocabulary")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", help="append the line to this file")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    if args.compile_backend:  # every torch.compile of this process (the bench's too)
        import torch

        torch.compile = functools.partial(torch.compile, backend=args.compile_backend)
    line = run_one(args)
    text = json.dumps(line, default=str) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0 if line["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
