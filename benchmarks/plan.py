"""The planner's predictions against measurement: step time and peak memory.

    python benchmarks/plan.py [--models gpt,llama] [--batch 8] [--steps 6]

For the workbench GPT (``small``: 4 layers, d=128, 128 tokens a row) and a Hugging Face
Llama built from a config (4 layers, d=256, MLP 704, 128 tokens a row; no download), the
planner surveys the model (``mixprec.planner.survey``), then for several configurations
predicts the step time and peak from that survey and measures them: the plan itself
(``goal=fastest``), every Linear in fp8-current, every Linear in MXFP8, MLPs in
fp8-current with attention in bf16, and bf16 Linears with int8 optimizer states. Each
measurement is a fresh copy of the model under the configuration's recipe (median of
``--steps`` steps after one warm-up; ``measure(peak=True)`` for the peak). The table
prints measured / predicted for both. MB = 1e6 bytes. Nothing is asserted here.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from mixprec.planner import measure_step, plan_from
from mixprec.planner.choose import choose
from mixprec.planner.survey import survey
from mixprec.recipe import Recipe
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def gpt(batch: int):
    torch.manual_seed(0)
    cfg = SIZES["small"]
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    return model, (idx, tgt), ("fc", "out")


def llama(batch: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (batch, 128))
    return model, {"input_ids": ids, "labels": ids}, ("gate_proj", "up_proj", "down_proj")


def configs(sv, mlp: tuple[str, ...]):
    fastest = choose(sv.layers, sv.units, sv.baselines)
    mixed = sv.uniform("bf16")
    for n in mixed.layers:
        if n.rsplit(".", 1)[-1] in mlp and sv.layers[n].options["fp8-current"].refused is None:
            mixed.layers[n] = "fp8-current"
    return {"plan (fastest)": fastest,
            "all fp8-current": sv.uniform("fp8-current"),
            "all mxfp8": sv.uniform("mxfp8"),
            "MLPs fp8-current": mixed,
            "bf16, int8 states": sv.uniform("bf16", "int8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"CPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models.split(","):
        model, batch, mlp = {"gpt": gpt, "llama": llama}[name](args.batch)
        sv = survey(model, batch, base=Recipe.parse("bf16-master"),
                    formats=("bf16", "fp8-current", "mxfp8"),
                    state_formats=("fp32", "bf16", "int8"), min_sqnr=0.0, loss_fn=None,
                    batches=[batch])
        print(f"\n{name}: 16-bit step {sv.baselines.step_16 * 1e3:.1f} ms, peak "
              f"{sv.baselines.peak_16 / 1e6:.1f} MB; fp8 shell step "
              f"{sv.baselines.step_shell * 1e3:.1f} ms, peak "
              f"{sv.baselines.peak_shell / 1e6:.1f} MB")
        print("| configuration | predicted step | measured step | meas/pred | "
              "predicted peak | measured peak | meas/pred |")
        print("|---|---|---|---|---|---|---|")
        for label, cfg in configs(sv, mlp).items():
            p = plan_from(sv, cfg)
            t, peak = measure_step(model, p.recipe, batch, None, steps=args.steps)
            print(f"| {label} | {p.predicted_step_s * 1e3:.1f} ms | {t * 1e3:.1f} ms | "
                  f"{t / p.predicted_step_s:.3f} | {p.predicted_peak / 1e6:.1f} MB | "
                  f"{peak / 1e6:.1f} MB | {peak / p.predicted_peak:.3f} |", flush=True)


if __name__ == "__main__":
    main()
