"""Which linear layers of a model break a low-precision recipe, and why: activation ranges per layer, and the
mismatch of quantizing one kind of layer at a time.

The policy, the task and the engine come from the composed ``ais-train`` config, built as ``ais-train`` builds them
(``ais_lightning.toolkit.probes.compose``: the same overrides, e.g. ``policy=smollm2 task=arithmetic``, also accepted
after ``--``). Sequences are sampled once by the run's engine at the trainer's precision (its fp32 copy, built as
training builds it; the torch engine at fp32 for an engine without one) (``--prompts`` task prompts x
``--samples``, ``--temperature``, ``--max-new-tokens``); then:

1. **Activation ranges.** ``max |x|`` per input channel of every linear over the prompt and response tokens
   (``ais_lightning.quant.InputRange``): per layer the largest channel range, the median channel range and
   their ratio, the outlier features of Dettmers et al. 2022 (arXiv 2208.07339). The ``--top`` largest ratios
   are printed.
2. **Which layers break.** A copy of the model with only one kind of linear (``q_proj``, ``k_proj``, ...)
   quantized by ``--recipe`` (``ais_lightning.quant.quantize_model``, emulated), with and without the
   ``--outlier-fraction`` of input channels kept in fp32 (the largest ranges of step 1, measured unquantized
   on the same sequences, as the engine's calibration pass does), scored on the sampled sequences: the exact KL(mu || pi) over the
   vocabulary, averaged over response tokens (teacher-forced, so no sampling noise), and the same for every
   kind at once.

Example (the tables in docs/real_model.md)::

    python tools/activation_outliers.py --recipe int8 --outlier-fraction 0.1 policy=smollm2 task=arithmetic
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear kinds of a Llama-family decoder layer."""


def full_logprobs(model, batch) -> torch.Tensor:
    """Log-softmax over the vocabulary at every response position of ``batch``: ``[B, T, V]``."""
    from ais_lightning.policy.policy import build_sequences

    ids, mask, positions = build_sequences(
        batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
    )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    p = batch.prompt_ids.shape[1]
    return logits[:, p - 1 : -1].float().log_softmax(-1)  # [B, T, V]


def exact_kl(mu: torch.Tensor, pi: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over valid response tokens of KL(mu || pi) = sum_v mu_v (log mu_v - log pi_v); mu, pi: [B, T, V]."""
    kl = (mu.exp() * (mu - pi)).sum(-1)  # [B, T]
    return float(kl[mask].mean())


def real_tokens(batch) -> torch.Tensor:
    """``[B, P + T]`` bool: the prompt and response tokens of ``batch`` that are not padding."""
    return torch.cat([batch.prompt_mask, batch.response_mask], dim=1)


def input_ranges(model, batch) -> dict[str, torch.Tensor]:
    """``max |x|`` per input channel of every ``nn.Linear`` (lm_head excluded) over the batch's real tokens
    (padding excluded, as the engine's packed prefill sees them)."""
    from ais_lightning.quant import InputRange

    real = real_tokens(batch)
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            observer = ranges[name] = InputRange(module.in_features)
            hooks.append(
                module.register_forward_pre_hook(lambda _, args, o=observer: o.update(args[0][real]))
            )
    full_logprobs(model, batch)
    for h in hooks:
        h.remove()
    return {name: r.amax for name, r in ranges.items()}


def quantized_copy(
    policy, recipe: str, kinds: tuple[str, ...], fraction: float, ranges: dict[str, torch.Tensor]
):
    """The policy's model with only the linears whose name ends in one of ``kinds`` quantized (emulated), the
    ``fraction`` of their input channels with the largest unquantized ``ranges`` (:func:`input_ranges` of the
    policy's model) kept in fp32."""
    from ais_lightning.quant import QuantLinear, largest_channels, outlier_count, quantize_model

    model = policy.fresh_model()
    model.load_state_dict(policy.model.state_dict())
    skip = [k for k in KINDS if k not in kinds] + ["lm_head", "embed", "norm"]
    quantize_model(model.eval(), recipe, backend="emulate", skip=skip)
    if fraction > 0:
        layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        for name, layer in layers.items():
            layer.set_outlier_channels(
                largest_channels(ranges[name], outlier_count(layer.in_features, fraction))
            )
    return model


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.toolkit.measure import sampling_config
    from ais_lightning.toolkit.probes import (
        add_overrides_argument,
        compose,
        fp32_engine,
        training_engine,
        write_json,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="int8", help="an ais_lightning.quant recipe")
    p.add_argument("--outlier-fraction", type=float, default=0.1, help="the int8 engine's default")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=12, help="layers with the largest range ratio to print")
    p.add_argument("--json", default=None)
    add_overrides_argument(p)
    args = p.parse_intermixed_args(argv)

    cfg, c = compose(args.overrides)
    policy = c.policy.build(cfg.seed).eval()
    samples = PromptDataModule(c.task, val_size=args.prompts, seed=args.seed).val_samples()
    sampling = sampling_config(
        policy.tokenizer, args.samples, args.temperature, args.max_new_tokens, args.seed
    )
    batch = training_engine(policy, fp32_engine(c, args.overrides)).generate(
        policy.encode_prompts([s.prompt for s in samples]), sampling
    )
    mask = batch.response_mask
    reference = full_logprobs(policy.model, batch)
    print(f"{int(mask.sum())} response tokens of {len(samples)} prompts x {args.samples} samples")

    ranges = input_ranges(policy.model, batch)
    stats = []
    for name, amax in ranges.items():
        median = float(amax.median())
        stats.append(
            {
                "layer": name,
                "max": float(amax.max()),
                "median": median,
                "ratio": float(amax.max()) / max(median, 1e-12),
                "channel": int(amax.argmax()),
            }
        )
    stats.sort(key=lambda r: -r["ratio"])
    print(
        "\n| layer | largest channel range | median channel range | ratio | channel |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for r in stats[: args.top]:
        print(f"| `{r['layer']}` | {r['max']:.1f} | {r['median']:.3f} | {r['ratio']:.0f} | {r['channel']} |")
    by_kind = {k: statistics.median(r["ratio"] for r in stats if r["layer"].endswith(k)) for k in KINDS}
    print("median ratio per kind: " + ", ".join(f"{k} {v:.0f}" for k, v in by_kind.items()))

    rows: list[dict[str, Any]] = []
    print(
        f"\n| {args.recipe} on | KL, every channel | KL, {args.outlier_fraction:g} of the channels kept in fp32 |\n"
        "| --- | ---: | ---: |"
    )
    for kinds in [*((k,) for k in KINDS), KINDS]:
        kl = [
            exact_kl(
                full_logprobs(quantized_copy(policy, args.recipe, kinds, f, ranges), batch), reference, mask
            )
            for f in (0.0, args.outlier_fraction)
        ]
        label = "every linear" if len(kinds) > 1 else kinds[0]
        rows.append({"kinds": list(kinds), "kl": kl[0], "kl_outliers_kept": kl[1]})
        print(f"| {label} | {kl[0]:.2e} | {kl[1]:.2e} |", flush=True)
    write_json(args.json, {"args": vars(args), "ranges": stats, "kinds": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
