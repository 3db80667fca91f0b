"""A training step's peak memory: ``estimate()``'s prediction against
``measure(..., peak=True)``'s measured high-water mark, for every preset.

    python benchmarks/memory_peak.py [--size medium] [--batch 8] [--recipes fp32,bf16] [--moe]

The workbench GPT (``--size``, the compare default ``medium``: 4 layers, d=256,
sequence 128) with each preset's optimizer (``mixprec.optim.adamw_for``), after two
steps. The prediction uses the model and a transformer spec of its shape
(``F.scaled_dot_product_attention``: flash, no dropout); the measurement takes one real
step (undone afterwards) under ``torch.profiler``'s memory events. MB = 2^20 bytes.

``--moe`` adds tiny transformers mixture-of-experts models (Mixtral, Qwen3-MoE,
DeepSeek-V3 and GPT-OSS built from config: 2 layers, hidden 64, 4 experts of 128, top-2,
vocabulary 128; nothing is downloaded) under the recipes that run their experts on
mixprec's grouped GEMM, batch 8 of 64 tokens; their prediction reads the model's own
modules (``mixprec.memory.moe``), with every expert at the average rows and with the
batch's routing (``estimate(..., sample_batch=)``). The experts run on the CPU's eager
``loop`` route, and every format with a sync-free module (``fp8-current``,
``fp8-rowwise``, ``int8-rowwise``, ``nvfp4``, ``fp8-block``, ``mxfp8``) also on the
``grouped`` route that ``torch.compile`` takes (``mixprec.experts.segments*``: whole
operand casts, the tile formats' wgrad buffer padded to each expert's tiles), run
eagerly. No figure is asserted here (tests/memory/test_memory_peak.py asserts the bounds)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings

import torch

from mixprec import MixedPrecision
from mixprec.memory import TransformerSpec, estimate, measure
from mixprec.optim import adamw_for
from mixprec.recipe import PRESETS
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def peaks(recipe: str, size: str = "medium", batch: int = 8) -> tuple[float, float, float]:
    """``(steady, estimated peak, measured peak)`` in bytes for one preset."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1))
    spec = TransformerSpec(layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads,
                           seq_len=cfg.seq_len, micro_batch=batch, vocab=cfg.vocab,
                           attention="flash", dropout=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = estimate(model, recipe, activations=spec)
        engine = MixedPrecision(model, adamw_for(recipe, model.parameters(), lr=1e-3),
                                recipe)
        for _ in range(2):
            with engine.autocast():
                loss = model(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        got = measure(model, engine, (idx[:, :-1], idx[:, 1:]), peak=True)
    steady = sum(v for k, v in got.items.items() if k not in ("activations",
                                                               "weight_casts"))
    return steady, predicted.peak, got.peak


#: the MoE rows' recipes: 16-bit experts on transformers' grouped GEMM, and three formats
MOE_RECIPES = ("bf16-master", "fp8-current", "mxfp8", "nvfp4")
#: the formats with a sync-free ``grouped`` module, the MoE rows' ``grouped`` recipes
MOE_SYNC_FREE = ("fp8-current", "fp8-rowwise", "int8-rowwise", "nvfp4", "fp8-block", "mxfp8")
MOE_MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


def moe_model(kind: str, seed: int = 0):
    """A tiny transformers MoE causal LM from config (experts initialized N(0, 0.05))."""
    import transformers

    from mixprec.experts.hook import experts_modules

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=128,
                                         num_local_experts=4)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=128,
                                          moe_intermediate_size=128, num_experts=4,
                                          head_dim=16)
    elif kind == "deepseek_v3":  # multi-head latent attention, a shared expert
        cfg = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=128,
            moe_intermediate_size=128, n_routed_experts=4, n_group=1, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1)
    elif kind == "gpt_oss":  # eager attention with sinks, biased experts
        cfg = transformers.GptOssConfig(**common, intermediate_size=128,
                                        num_local_experts=4, head_dim=16)
    else:
        raise ValueError(f"kind={kind!r}; valid: {', '.join(MOE_MODELS)}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for m in experts_modules(model).values():  # transformers' init leaves some at 0
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
    return model


@contextlib.contextmanager
def experts_route(route: str):
    """mixprec's experts run their grouped GEMMs on ``route`` (``grouped`` on a CPU: the
    route ``torch.compile`` takes, sync-free for the block formats), eagerly."""
    from mixprec.experts import grouped, hook

    before = hook.grouped_mm
    if route != "loop":
        hook.grouped_mm = functools.partial(grouped.grouped_mm, route=route)
    try:
        yield
    finally:
        hook.grouped_mm = before


def _moe_inputs(kind: str, batch: int, seq: int, route: str):
    """The model, its batch and the spec its estimate takes."""
    model = moe_model(kind)
    idx = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    cfg = model.config
    spec = TransformerSpec(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                           heads=cfg.num_attention_heads, seq_len=seq, micro_batch=batch,
                           vocab=cfg.vocab_size, attention="flash", dropout=False,
                           experts_route=route)
    return model, {"input_ids": idx, "labels": idx}, spec


def moe_estimate(kind: str, recipe: str, batch: int = 8, seq: int = 64, *,
                 route: str = "loop") -> float:
    """The estimated peak in bytes with every expert at the average rows."""
    model, _, spec = _moe_inputs(kind, batch, seq, route)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(model, recipe, activations=spec).peak


def moe_peaks(kind: str, recipe: str, batch: int = 8, seq: int = 64, *,
              route: str = "loop", routed: bool = False) -> tuple[float, float, float]:
    """``(steady, estimated peak, measured peak)`` in bytes for a tiny MoE model, its
    experts on ``route``; ``routed``: the estimate reads the batch's routing
    (``estimate(..., sample_batch=)``) rather than taking every expert at the average."""
    model, data, spec = _moe_inputs(kind, batch, seq, route)
    with warnings.catch_warnings(), experts_route(route):
        warnings.simplefilter("ignore")
        predicted = estimate(model, recipe, activations=spec,
                             sample_batch=data if routed else None)
        engine = MixedPrecision(model, adamw_for(recipe, model.parameters(), lr=1e-3),
                                recipe)
        for _ in range(1):  # the optimizer's states exist after one step
            with engine.autocast():
                loss = model(**data).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        got = measure(model, engine, data, peak=True, loss_fn=lambda out: out.loss)
    steady = sum(v for k, v in got.items.items() if k not in ("activations",
                                                               "weight_casts"))
    return steady, predicted.peak, got.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--recipes", default=",".join(PRESETS))
    ap.add_argument("--moe", action="store_true",
                    help="also the tiny MoE rows (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS)")
    args = ap.parse_args()
    print(f"# benchmarks/memory_peak.py --size {args.size} --batch {args.batch}: "
          f"{cpu_name()}, torch {torch.__version__}")
    print("| recipe | steady MB | estimated peak MB | measured peak MB | estimate / measured |")
    print("|---|---|---|---|---|")
    mb = 2.0 ** 20
    for r in [r for r in args.recipes.split(",") if r]:  # --recipes '': the MoE rows only
        steady, est, got = peaks(r, args.size, args.batch)
        print(f"| `{r}` | {steady / mb:.1f} | {est / mb:.1f} | {got / mb:.1f} | "
              f"{est / got:.3f} |", flush=True)
    if args.moe:
        print("\n| model | recipe | route | steady MB | estimated peak MB (average rows) | "
              "estimated peak MB (batch's routing) | measured peak MB | "
              "estimate / measured (average) | estimate / measured (routing) |")
        print("|---|---|---|---|---|---|---|---|---|")
        runs = [(k, r, "loop") for k in MOE_MODELS for r in MOE_RECIPES]
        runs += [(k, r, "grouped") for k in MOE_MODELS for r in MOE_SYNC_FREE]
        for kind, r, route in runs:
            average = moe_estimate(kind, r, route=route)
            steady, est, got = moe_peaks(kind, r, route=route, routed=True)
            print(f"| {kind} | `{r}` | {route} | {steady / mb:.1f} | {average / mb:.2f} | "
                  f"{est / mb:.2f} | {got / mb:.2f} | {average / got:.3f} | "
                  f"{est / got:.3f} |", flush=True)

if __name__ == "__main__":
    main()
