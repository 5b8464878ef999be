"""Quantization error of every recipe, from one run: weight MSE and the teacher-forced mismatch KL.

For each recipe (default: the Bit-by-Bit nested integer recipes with and without outlier channel
splitting, plus ``int8``, ``fp8`` and ``nvfp4`` for reference), all emulated (``backend="emulate"``,
exact fake quantization in fp32 on CPU):

- **weight MSE, outliers**: relative MSE ``||W_q - W||^2 / ||W||^2`` of one ``[256, 512]`` Gaussian weight
  whose 1% heaviest input channels (5 columns) are scaled by 10 (the setting OCS targets);
- **weight MSE, tiny Qwen3**: the same ratio summed over every quantized linear of the policy's model, built as
  ``ais-train`` builds it (``ais_lightning.toolkit.probes.compose``; default the built-in tiny Qwen3, ``policy=tiny_qwen3``
  initialised from ``--seed``: random init, Gaussian weights, no outliers);
- **KL**: the token-level mismatch ``KL(mu || pi) = sum_v mu(v) (log mu(v) - log pi(v))`` between the
  quantized model ``mu`` (``quantize_model(copy, recipe)``: embeddings, ``lm_head`` and norms stay fp32) and
  the fp32 model ``pi``, exact over the vocabulary, teacher-forced (the same random token sequences
  through both), mean and max over all positions. The direction is that of the repository's
  ``MismatchKL`` (rollout policy first);
- **batch dep.**: max over positions of ``|log mu(v)|`` differences (all ``v``) between the first sequence
  run alone and inside the batch: 0 when the recipe quantizes every token independently of the others;
- **ulp sens.**: the same for every input embedding moved by one float32 ulp (``torch.nextafter``): how
  much a last-bit difference between two fp32 implementations (e.g. a rollout engine's fused kernels
  and the trainer's) can move the quantized model's log-probs through the rounding decisions it flips.

``W_q`` is ``QuantLinear.effective_weight()`` (for OCS recipes the split columns summed back).

A second table is the OCS ablation on the outlier weight (nested grids, E4M3 groups of 32): relative
MSE without splitting, with OCS's plain split (halves, then the usual amax-scaled quantization of
the split weight) and with the rounding-aware split (:func:`ais_lightning.quant.ocs_split`), at split
ratios 0.01, 0.05 and 0.1. A third table compares the E4M3 block-scale rounding of ``group_e4m3``
(rounded up, so nothing saturates) with NVFP4's round-to-nearest on a ``[512, 512]`` Gaussian weight.

Usage: .venv/bin/python tools/quant_error.py [--batch 16] [--seq 64] [--seed 0] [--recipes a,b,...]
[--model HF_DIR] [--json out.json] [OVERRIDES...]. ``--model``: a local Hugging Face causal LM directory instead of
the random tiny Qwen3 (loaded offline: ``policy=local policy.path=HF_DIR``); any ``ais-train`` policy overrides
pick another model (e.g. ``policy=smollm2``, ``policy.overrides.num_hidden_layers=2``). Prints markdown tables.
Deterministic (no timing involved).
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.quant import (
    FORMATS,
    NESTED_INT_RECIPES,
    QuantLinear,
    fake_quantize,
    get_recipe,
    ocs_split,
    quantize_model,
)

REFERENCE_RECIPES = ("int8", "fp8", "nvfp4")
"""Existing recipes shown next to the nested integer ones."""
DEFAULT_RECIPES = REFERENCE_RECIPES + NESTED_INT_RECIPES
ABLATION_RATIOS = (0.01, 0.05, 0.1)
"""OCS split ratios of the ablation table."""


def outlier_weight(
    seed: int, n: int = 256, k: int = 512, frac: float = 0.01, factor: float = 10.0
) -> torch.Tensor:
    """A ``[n, k]`` standard Gaussian weight with ``ceil(frac * k)`` random input columns scaled by ``factor``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)  # [N, K]
    cols = torch.randperm(k, generator=g)[: math.ceil(frac * k)]
    w[:, cols] *= factor
    return w


def relative_weight_mse(weights: list[torch.Tensor], recipe: str) -> float:
    """``sum ||W_q - W||^2 / sum ||W||^2`` over ``weights`` quantized as ``recipe``'s weight (emulated)."""
    num = den = 0.0
    for w in weights:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(w)
        w_q = QuantLinear.from_linear(linear, recipe, backend="emulate").effective_weight()
        num += float(((w_q - w) ** 2).sum())
        den += float((w**2).sum())
    return num / den


def token_kl(logits_q: torch.Tensor, logits_ref: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(logits_q) || softmax(logits_ref))`` per position.  logits: [B, T, V] -> [B, T]"""
    lq = F.log_softmax(logits_q.double(), dim=-1)
    lr = F.log_softmax(logits_ref.double(), dim=-1)
    return (lq.exp() * (lq - lr)).sum(-1).clamp(min=0.0)


def ocs_ablation(seed: int = 0, ratios=ABLATION_RATIOS, scaling: str = "group_e4m3") -> list[dict]:
    """Relative MSE of the outlier weight: no split, plain split, rounding-aware split, per format and ratio."""
    w = outlier_weight(seed)
    den = float((w**2).sum())
    rows = []
    for fmt in ("nint8", "nint4", "nint2"):
        none = float(((fake_quantize(w, fmt, scaling) - w) ** 2).sum()) / den
        for ratio in ratios:
            plain = ocs_split(w, ratio=ratio)
            plain_q = plain.merge(fake_quantize(plain.weight, fmt, scaling))
            aware = ocs_split(w, ratio=ratio, fmt=fmt, scaling=scaling)
            aware_q = aware.merge(aware.dequantized())
            rows.append(
                {
                    "fmt": fmt,
                    "ratio": ratio,
                    "n_split": aware.n_split,
                    "none": none,
                    "plain": float(((plain_q - w) ** 2).sum()) / den,
                    "rounding_aware": float(((aware_q - w) ** 2).sum()) / den,
                }
            )
    return rows


def nearest_e4m3_fake_quantize(w: torch.Tensor, fmt: str, group: int = 32) -> torch.Tensor:
    """``group_e4m3`` fake quantization of ``w [N, K]`` (K a multiple of ``group``) with the E4M3 block
    scale rounded to nearest (NVFP4's rule) instead of up; everything else as in ``quant/scaling.py``."""
    f, e4m3 = FORMATS[fmt], FORMATS["fp8_e4m3"]
    n, k = w.shape
    wb = w.reshape(n, k // group, group)  # [N, G, group]
    second = w.abs().max() / (f.scale_max * e4m3.max)
    block = e4m3.round(wb.abs().amax(-1) / f.scale_max / second).clamp(min=2.0**-9)  # [N, G]
    step = (block * second)[..., None]
    return (f.decode(f.encode(wb / step)) * step).reshape(n, k)


def scale_rounding_ablation(seed: int = 0) -> list[dict]:
    """Relative MSE of a Gaussian ``[512, 512]`` weight, E4M3 block scales rounded up vs to nearest."""
    w = torch.randn(512, 512, generator=torch.Generator().manual_seed(seed))
    den = float((w**2).sum())
    return [
        {
            "fmt": fmt,
            "up": float(((fake_quantize(w, fmt, "group_e4m3") - w) ** 2).sum()) / den,
            "nearest": float(((nearest_e4m3_fake_quantize(w, fmt) - w) ** 2).sum()) / den,
        }
        for fmt in ("nint8", "nint4", "nint2")
    ]


def policy_overrides(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``ais-train`` overrides of the model to measure: ``--model``'s directory as ``policy=local``, then
    ``overrides``."""
    from ais_lightning.toolkit.probes import override

    local = [] if path is None else ["policy=local", override("policy.path", path)]
    return [*local, *overrides]


def load_model(seed: int, path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> nn.Module:
    """The fp32 model to measure, the policy's as ``ais-train`` builds it: the random tiny Qwen3 by default, a local
    Hugging Face directory (``path``), or what ``overrides`` pick."""
    from ais_lightning.toolkit.probes import compose

    _, c = compose(policy_overrides(path, overrides))
    return c.policy.build(seed).model.float().eval()


def measure(
    recipes=DEFAULT_RECIPES,
    batch: int = 16,
    seq: int = 64,
    seed: int = 0,
    model_path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> list[dict]:
    """One row per recipe: bits, OCS, the two weight MSEs and the KL statistics."""
    for name in recipes:
        get_recipe(name)  # fail before any work on an unknown name
    model = load_model(seed, model_path, overrides)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)  # [B, T]
    with torch.no_grad():
        ref = model(ids).logits  # [B, T, V]
    linears = [m.weight.detach() for n, m in model.named_modules() if _quantized_by_default(n, m)]
    synthetic = [outlier_weight(seed)]
    rows = []
    for name in recipes:
        recipe = get_recipe(name)
        q_model = quantize_model(copy.deepcopy(model), recipe, backend="emulate")
        with torch.no_grad():
            logits = q_model(ids).logits  # [B, T, V]
            kl = token_kl(logits, ref)  # [B, T]
            alone = q_model(ids[:1]).logits  # [1, T, V]
            emb = q_model.get_input_embeddings()(ids)  # [B, T, H]
            nudged = q_model(inputs_embeds=torch.nextafter(emb, torch.full_like(emb, math.inf))).logits
        logp = F.log_softmax(logits.double(), -1)
        rows.append(
            {
                "recipe": name,
                "weight": recipe.weight_fmt,
                "activation": recipe.act_fmt or "-",
                "ocs": recipe.ocs_ratio,
                "mse_outliers": relative_weight_mse(synthetic, name),
                "mse_model": relative_weight_mse(linears, name),
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
                "batch_dep": float((F.log_softmax(alone.double(), -1) - logp[:1]).abs().max()),
                "ulp_sens": float((F.log_softmax(nudged.double(), -1) - logp).abs().max()),
            }
        )
    return rows


def _quantized_by_default(name: str, module: nn.Module) -> bool:
    from ais_lightning.quant import DEFAULT_SKIP

    return isinstance(module, nn.Linear) and not any(s in name for s in DEFAULT_SKIP)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| recipe | weight | activation | OCS | rel. weight MSE, outliers | rel. weight MSE, model "
        "| KL mean | KL max | batch dep. | ulp sens. |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ocs = f"{r['ocs']:.2f}" if r["ocs"] else "-"
        lines.append(
            f"| `{r['recipe']}` | {r['weight']} | {r['activation']} | {ocs} | {r['mse_outliers']:.3e} "
            f"| {r['mse_model']:.3e} | {r['kl_mean']:.3e} | {r['kl_max']:.3e} | {r['batch_dep']:.1e} "
            f"| {r['ulp_sens']:.1e} |"
        )
    return "\n".join(lines)


def markdown_ablation(rows: list[dict]) -> str:
    lines = [
        "| format | split ratio | channels split | no split | plain split | rounding-aware split |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['fmt']} | {r['ratio']:.2f} | {r['n_split']} | {r['none']:.3e} | {r['plain']:.3e} "
            f"| {r['rounding_aware']:.3e} |"
        )
    return "\n".join(lines)


def markdown_scale_rounding(rows: list[dict]) -> str:
    lines = ["| format | E4M3 scale rounded up | to nearest |", "| --- | ---: | ---: |"]
    lines += [f"| {r['fmt']} | {r['up']:.3e} | {r['nearest']:.3e} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    from ais_lightning.toolkit.probes import add_overrides_argument, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="random sequences")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0, help="model, prompts and synthetic weight seed")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated recipe names")
    parser.add_argument(
        "--model", default=None, help="local Hugging Face model directory (default: tiny Qwen3)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    if args.batch < 1 or args.seq < 1:
        parser.error("--batch and --seq must be >= 1")
    recipes = tuple(r for r in args.recipes.split(",") if r)
    result = {
        "recipes": measure(recipes, args.batch, args.seq, args.seed, args.model, args.overrides),
        "ocs_ablation": ocs_ablation(args.seed),
        "scale_rounding": scale_rounding_ablation(args.seed),
    }
    model = args.model or f"tiny Qwen3 (seed {args.seed}, random init)"
    if args.overrides:
        model += f", {' '.join(args.overrides)}"
    print(
        f"{model}, {args.batch} x {args.seq} random tokens, teacher-forced; KL(quantized || fp32) per token"
    )
    print(markdown(result["recipes"]))
    print()
    print("OCS ablation: relative weight MSE of the outlier weight, E4M3 groups of 32")
    print(markdown_ablation(result["ocs_ablation"]))
    print()
    print("E4M3 block-scale rounding: relative weight MSE of a 512 x 512 Gaussian weight, groups of 32")
    print(markdown_scale_rounding(result["scale_rounding"]))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
