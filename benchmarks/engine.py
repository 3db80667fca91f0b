"""Engine overhead and bf16 speed-up on the workbench GPT, against hand-written loops.

    python benchmarks/engine.py [--layers 6 --d-model 512 --batch 8 --seq 256 --steps 8]
                                [--recipe bf16] [--pieces] [--control] [--profile]

Loops train the same GPT on the same batch, interleaved step by step in two phases
(engine vs hand-written bf16 for the overhead; fp32, hand-written bf16 and the engine
for the speed-ups), the order rotating every round, so a noisy neighbour hits all the
loops of a phase alike.
- ``fp32``: plain torch, AdamW(fused=True);
- ``hand bf16``: ``torch.autocast("cpu", bfloat16)`` + the same optimizer, by hand;
- ``mixprec``: ``MixedPrecision(model, opt, recipe)`` (``--recipe``, default ``bf16``):
  the same plus FP32 islands (layer_norm, softmax, loss in fp32), the non-finite check
  and skip, and the global gradient norm. With another recipe (``bf16,wgrad=fp32``,
  ``bf16-master``) the "overhead" is what that recipe costs over the plain bf16 loop.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from gpt_args import add_gpt_arguments, gpt_config  # benchmarks/, next to this script
from mixprec import MixedPrecision
from mixprec.engine.context import make_emulation_mode
from mixprec.workbench import GPT
from mixprec.workbench.bench import paired_overhead
from mixprec.workbench.compare import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_gpt_arguments(ap, steps=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recipe", default="bf16", help="the engine's recipe (default bf16)")
    ap.add_argument("--control", action="store_true",
                    help="also time the hand-written bf16 loop against a second instance "
                         "of itself: the noise floor of the overhead figure")
    ap.add_argument("--pieces", action="store_true",
                    help="also time forward, backward and step apart (engine vs hand, "
                         "alternating each step): where the overhead is")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 3 steps of the engine and of fp32 (torch.profiler): "
                         "where a step's time goes, by op")
    args = ap.parse_args()
    cfg = gpt_config(args)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]

    def make():
        torch.manual_seed(0)
        m = GPT(cfg)
        return m, torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)

    m32, o32 = make()
    mh, oh = make()
    me, oe = make()
    engine = MixedPrecision(me, oe, args.recipe)

    def fp32_step():
        loss = m32(x, y)
        loss.backward()
        o32.step()
        o32.zero_grad(set_to_none=True)

    # where the engine emulates bf16 (a CPU without bf16 units), its hand-written twin
    # enters the same emulation mode by hand, so both run the same kernels
    def hand_loop(m, o):
        emu = make_emulation_mode(engine.recipe) if engine.emulating else None
        emu = emu if emu is not None else contextlib.nullcontext()

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16), emu:
                loss = m(x, y)
            with emu:
                loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        return step

    hand_step = hand_loop(mh, oh)

    def engine_step():
        with engine.autocast():
            loss = me(x, y)
        engine.backward(loss)
        engine.step()

    def measure(loops):
        names = list(loops)
        times = {k: [] for k in loops}
        for i in range(args.warmup + args.steps):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate order
                t = time.perf_counter()
                loops[name]()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t)
        return times

    # Two phases, each an interleaved pair: the fp32 loop's large allocations perturb
    # whichever loop follows it, so it is kept out of the overhead comparison.
    mine = f"mixprec {args.recipe}"
    over_t = measure({"hand bf16": hand_step, mine: engine_step})
    speed_t = measure({"fp32": fp32_step, "hand bf16": hand_step, mine: engine_step})
    over, speed = ({k: statistics.median(v) for k, v in t.items()} for t in (over_t, speed_t))
    tokens = args.batch * args.seq
    print(f"# GPT {args.layers}x{args.d_model} ({cfg.n_params / 1e6:.1f}M params), batch "
          f"{args.batch}x{args.seq}, median of {args.steps} interleaved steps per phase, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()}, "
          f"engine {'emulating' if engine.emulating else 'on real kernels'}")
    w = max(14, len(mine))
    print(f"{'phase':<10} {'loop':<{w}} {'step (ms)':>10} {'tokens/s':>10}")
    for phase, med in (("overhead", over), ("speed-up", speed)):
        for k, v in med.items():
            print(f"{phase:<10} {k:<{w}} {v * 1e3:>10.1f} {tokens / v:>10.0f}")
    med, q25, q75 = paired_overhead(over_t[mine], over_t["hand bf16"])
    print(f"engine overhead vs hand-written bf16 loop: {med * 100:+.1f}% (median of "
          f"per-round ratios, IQR {q25 * 100:+.1f}..{q75 * 100:+.1f}%; ratio of medians "
          f"{(over[mine] / over['hand bf16'] - 1) * 100:+.1f}%)")
    print(f"speed-up over fp32 (same phase): {mine} "
          f"{speed['fp32'] / speed[mine]:.2f}x, hand-written bf16 "
          f"{speed['fp32'] / speed['hand bf16']:.2f}x")
    if args.control:
        ctl = measure({"hand bf16": hand_step, "hand bf16 (2nd)": hand_loop(*make())})
        med, q25, q75 = paired_overhead(ctl["hand bf16 (2nd)"], ctl["hand bf16"])
        print(f"control, the same hand-written loop on a second model instance: "
              f"{med * 100:+.1f}% (IQR {q25 * 100:+.1f}..{q75 * 100:+.1f}%; what "
              "'overhead' reads when there is none)")
    if args.pieces:
        pieces(args, engine, me, mh, oh, x, y)
    if args.profile:
        profile_by_op({mine: engine_step, "fp32": fp32_step})


#: ops grouped for the profile table (self CPU time of each aten op)
GROUPS = {
    "GEMMs (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention forward": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "attention backward": ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",),
    "casts and copies": ("aten::copy_",),
    "GELU forward + backward": ("aten::gelu", "aten::gelu_backward"),
    "LayerNorm forward + backward": ("aten::native_layer_norm",
                                     "aten::native_layer_norm_backward"),
    "optimizer (fused AdamW)": ("aten::_fused_adamw_",),
}


def profile_by_op(loops: dict, steps: int = 3) -> None:
    """Self CPU time per step of each op group (the rest summed as 'other'), per loop."""
    from torch.profiler import profile

    for name, step in loops.items():
        step()
        with profile() as prof:
            for _ in range(steps):
                step()
        self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
        total = sum(self_ms.values())
        print(f"\n## where a step's time goes: {name} (torch.profiler, self CPU time, "
              f"mean of {steps} steps: {total:.0f} ms)")
        rest = total
        for group, ops in GROUPS.items():
            ms = sum(self_ms.get(op, 0.0) for op in ops)
            rest -= ms
            print(f"{group:<30} {ms:>8.1f} ms {ms / total:>6.1%}")
        print(f"{'other':<30} {rest:>8.1f} ms {rest / total:>6.1%}")


def pieces(args, engine, me, mh, oh, x, y) -> None:
    """Median forward / backward / step of the engine and the hand loop, alternating."""
    names = ("forward", "backward", "step")
    t = {(who, n): [] for who in ("mixprec", "hand") for n in names}

    def timed(who, fwd, bwd, stp):
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        bwd(loss)
        t2 = time.perf_counter()
        stp()
        t3 = time.perf_counter()
        return dict(zip(((who, n) for n in names), (t1 - t0, t2 - t1, t3 - t2)))

    def e_fwd():
        with engine.autocast():
            return me(x, y)

    emu = make_emulation_mode(engine.recipe) if engine.emulating else None
    emu = emu if emu is not None else contextlib.nullcontext()

    def h_fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16), emu:
            return mh(x, y)

    def h_bwd(loss):
        with emu:
            loss.backward()

    def h_step():
        oh.step()
        oh.zero_grad(set_to_none=True)

    runs = (("mixprec", e_fwd, engine.backward, engine.step),
            ("hand", h_fwd, h_bwd, h_step))
    for i in range(args.warmup + args.steps):
        for run in runs[i % 2:] + runs[:i % 2]:
            got = timed(*run)
            if i >= args.warmup:
                for k, v in got.items():
                    t[k].append(v)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    print(f"{'piece':<10} {'hand (ms)':>10} {'mixprec (ms)':>13} {'difference':>11}")
    for n in names:
        print(f"{n:<10} {med[('hand', n)]:>10.1f} {med[('mixprec', n)]:>13.1f} "
              f"{med[('mixprec', n)] - med[('hand', n)]:>+10.1f}")
    total = {w: sum(med[(w, n)] for n in names) for w in ("hand", "mixprec")}
    print(f"sum of pieces: mixprec {(total['mixprec'] / total['hand'] - 1) * 100:+.1f}% "
          f"over hand")


if __name__ == "__main__":
    main()
