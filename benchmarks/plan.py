"""The planner's predictions against measurement: step time and peak memory.

    python benchmarks/plan.py [--models gpt,llama,mixtral,qwen3_moe] [--batch 8]
                              [--steps 8] [--size small] [--device cpu]
                              [--seconds 0.25] [--clock wall|cpu]

For the workbench GPT (``small``: 4 layers, d=128, 128 tokens a row), a Hugging Face
Llama built from a config (4 layers, d=256, MLP 704, 128 tokens a row; no download) and
two mixture-of-experts models built from configs (``mixtral``, ``qwen3_moe``: 2 layers,
d=256, 8 experts of intermediate 512 / 256, top-2, 128 tokens a row; their experts
modules are planner candidates beside the Linears), the planner surveys the model
(``mixprec.planner.survey``), then for several configurations predicts the step time
and peak from that survey and measures them: the plan itself (``goal=fastest``), every
Linear (and experts module) in fp8-current, every one in MXFP8 (these two marked ``*``:
the survey measured their steps to scale its per-Linear timings, so their predicted
step is a re-measurement), MLPs (the experts) in fp8-current with the rest in bf16, MLPs
in MXFP8 with the rest in fp8-current, on the MoE models the experts in MXFP8 with the
rest in bf16, and bf16 Linears with int8 optimizer states for every module or every
other one. Step times are compared as ratios to the 16-bit recipe's (``bf16-master``):
the prediction's to the survey's measured 16-bit step, the measurement's to a 16-bit
copy stepped in turn with it (median of ``--steps``, the turns' order reversed every
round), so that a busy machine slows both alike.
``--clock cpu`` runs one thread and reads every timer (the survey's and these) as this
process's CPU seconds, which other jobs on a shared, loaded machine do not stretch. The
peak is one step of a fresh copy under ``measure(peak=True)``. The table prints
measured / predicted for both. MB = 1e6 bytes. Nothing is asserted here.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from mixprec.planner import measure_step, measure_steps, plan_from
from mixprec.planner.choose import choose
from mixprec.planner.survey import survey
from mixprec.recipe import Recipe
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def gpt(batch: int, size: str = "small"):
    torch.manual_seed(0)
    cfg = SIZES[size]
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    return model, (idx, tgt), ("fc", "out")


def _causal_lm(cls, cfg, batch: int, mlp: tuple[str, ...]):
    """A transformers causal LM ``cls(cfg)`` (seed 0), a batch of ``batch`` rows of 128
    random tokens as its own labels, and the names of its MLP modules."""
    torch.manual_seed(0)
    model = cls(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, 128))
    return model, {"input_ids": ids, "labels": ids}, mlp


def llama(batch: int, size: str = "small"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, attn_implementation="sdpa")
    return _causal_lm(LlamaForCausalLM, cfg, batch, ("gate_proj", "up_proj", "down_proj"))


def mixtral(batch: int, size: str = "small"):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=256, attn_implementation="sdpa")
    return _causal_lm(MixtralForCausalLM, cfg, batch, ("experts",))


def qwen3_moe(batch: int, size: str = "small"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=256, attn_implementation="sdpa")
    return _causal_lm(Qwen3MoeForCausalLM, cfg, batch, ("experts",))


MODELS = {"gpt": gpt, "llama": llama, "mixtral": mixtral, "qwen3_moe": qwen3_moe}


def configs(sv, mlp: tuple[str, ...]):
    fastest = choose(sv.layers, sv.units, sv.baselines)

    def mlps_in(fmt):  # the MLPs (or experts) in fmt, the rest in bf16
        cfg = sv.uniform("bf16")
        for n in cfg.layers:
            if n.rsplit(".", 1)[-1] in mlp and sv.layers[n].options[fmt].refused is None:
                cfg.layers[n] = fmt
        return cfg

    mixed = mlps_in("fp8-current")
    two = sv.uniform("fp8-current")
    for n in two.layers:
        if n.rsplit(".", 1)[-1] in mlp and sv.layers[n].options["mxfp8"].refused is None:
            two.layers[n] = "mxfp8"
    half = sv.uniform("bf16", "fp32")
    for i, u in enumerate(half.states):
        if i % 2:
            half.states[u] = "int8"
    what = "experts" if mlp == ("experts",) else "MLPs"
    return {"plan (fastest)": fastest,
            "all fp8-current *": sv.uniform("fp8-current"),
            "all mxfp8 *": sv.uniform("mxfp8"),
            f"{what} fp8-current, rest bf16": mixed,
            f"{what} mxfp8, rest fp8-current": two,
            **({"experts mxfp8, rest bf16": mlps_in("mxfp8")} if what == "experts" else {}),
            "bf16, int8 states": sv.uniform("bf16", "int8"),
            "bf16, every other module's states int8": half}


def interleaved(model, recipes: list, batch, steps: int) -> list[float]:
    """Median step seconds of each recipe on its own copy of ``model``, the recipes'
    steps taken in turn so that a busy machine slows each alike, the order of the turns
    reversed every round (``mixprec.planner.measure_steps``): two copies of the 16-bit
    recipe of a config-built Mixtral, stepped in one fixed order, read the first copy's
    forward and backward 0-28 ms (up to 18%) longer than the second's (median of their
    2nd to 9th steps, 5 runs); with the order reversed every round, within 2 ms (2
    runs)."""
    got = measure_steps(model, [(r, None) for r in recipes], batch, None, steps=steps,
                        peak=False)
    return [t for t, _ in got]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", default="small", help="the workbench GPT's size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=0.25,
                    help="the survey's timing window per Linear shape and format")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: one thread, every timer reads this process's CPU seconds")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.clock == "cpu":
        # the survey's timers and this script's all call time.perf_counter: on a shared,
        # loaded CPU, CPU seconds of one thread are what other jobs do not stretch
        torch.set_num_threads(1)
        time.perf_counter = time.process_time
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda") else
             f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})")
    print(f"device: {where}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.clock} clock")
    for name in args.models.split(","):
        model, batch, mlp = MODELS[name](args.batch, args.size)
        model = model.to(args.device)
        batch = ({k: v.to(args.device) for k, v in batch.items()} if isinstance(batch, dict)
                 else tuple(t.to(args.device) for t in batch))
        base = Recipe.parse("bf16-master")
        sv = survey(model, batch, base=base, formats=("bf16", "fp8-current", "mxfp8"),
                    state_formats=("fp32", "bf16", "int8"), min_sqnr=0.0, loss_fn=None,
                    batches=[batch], seconds=args.seconds)
        b = sv.baselines
        print(f"\n{name}: 16-bit step {b.step_16 * 1e3:.1f} ms, peak "
              f"{b.peak_16 / 1e6:.1f} MB; fp8 shell step {b.step_shell * 1e3:.1f} ms, "
              f"peak {b.peak_shell / 1e6:.1f} MB; whole-step scales "
              + ", ".join(f"{f} {k:.2f}" for f, k in sorted(b.time_scale.items())))
        for line in sv.noise:
            print(f"  noisy: {line}")
        print("| configuration | predicted step / 16-bit | measured step / 16-bit | "
              "meas/pred | predicted peak | measured peak | meas/pred |")
        print("|---|---|---|---|---|---|---|")
        for label, cfg in configs(sv, mlp).items():
            p = plan_from(sv, cfg)
            t_cfg, t_16 = interleaved(model, [p.recipe, base], batch, args.steps)
            _, peak = measure_step(model, p.recipe, batch, None, steps=1)
            pred = p.predicted_step_s / b.step_16
            got = t_cfg / t_16
            print(f"| {label} | {pred:.2f}x | {got:.2f}x | {got / pred:.3f} | "
                  f"{p.predicted_peak / 1e6:.1f} MB | {peak / 1e6:.1f} MB | "
                  f"{peak / p.predicted_peak:.3f} |", flush=True)


if __name__ == "__main__":
    main()
