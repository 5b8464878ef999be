"""Where a torch-engine rollout spends its time: per-operator CPU time of the prefill and of a decode step.

Profiles two ``generate`` calls of one ``TorchRolloutEngine`` with ``torch.profiler`` on a
``tools/bench_rollout.py`` config (same model and prompts, built as ``ais-train`` builds them; more ``ais-train``
overrides apply on top; the engine is ``rollout.precision=<--precision> rollout.model_impl=<--model-impl>`` of the
torch engine): one that only prefills (1 new token) and
one of full length. An operator's decode cost per step is its time in the full call minus its time
in the prefill-only call, divided by the extra steps. Self time is used (an operator's own time,
without the operators it calls), so the rows add up to the total.

``--functions`` adds the same per-step table by *function of the engine*: two more profiled calls with
Python stacks (``with_stack=True``), each operator's self time (and each function's own Python time)
charged to the chain of ``ais_lightning`` functions it ran under, below the sampling loop of
``torch_engine`` (only chains entered at every decode step: the prefill's are left out; e.g. ``decoders.step > torch_model.decode_layer > torch_model.mlp_residual``,
``decoders.step > torch_model.logits``: the final norm and the LM head, ``sampling.sample_next >
sampling.sampling_logprobs``: the log-softmax over the vocabulary). It is shown rolled up to the first
two functions of each chain, and in full.

The profiler adds overhead to every operator call, which weighs most on the many small ones (the Python
stacks add more); read the shares and the large rows, and take speed from ``tools/bench_rollout.py``. The
unprofiled decode ms/step of the same engine (the same two calls timed without the profiler) is reported
beside the profiled one.

    python tools/profile_rollout.py --config gemm --precision int8 --threads 2
    python tools/profile_rollout.py --config gemm --precision int8 --model-impl transformers   # the model's forward
    python tools/profile_rollout.py --config smollm2 --precision fp32 --threads 2 --functions
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rollout  # noqa: E402  (a sibling script: same configs, model and prompts)

from ais_lightning.rollout.torch_engine import MODEL_IMPLS, PRECISIONS  # noqa: E402
from ais_lightning.toolkit.probes import add_overrides_argument, engine_factory, write_json  # noqa: E402
from ais_lightning.toolkit.profiling import markdown, profile_engine  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(bench_rollout.CONFIGS), default="gemm")
    parser.add_argument("--precision", choices=PRECISIONS, default="int8")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="override the config's new tokens (>= 2)"
    )
    parser.add_argument("--batch", type=int, default=None, help="rows (default: the config's largest batch)")
    parser.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="the engine's forward (transformers: the model's own)",
    )
    parser.add_argument(
        "--functions", action="store_true", help="also break the decode step down by function"
    )
    parser.add_argument("--top", type=int, default=15, help="operators listed per table")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    cfg = bench_rollout.CONFIGS[args.config]
    new = args.new_tokens or cfg.new_tokens
    if new < 2:
        parser.error(f"--new-tokens must be >= 2 (one prefill-only call is subtracted), got {new}")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    source = bench_rollout.load_source(cfg, args.overrides)
    batch = args.batch or max(cfg.batches)
    prompts = bench_rollout.make_prompts(cfg, batch, source)
    factory = engine_factory(
        [*source.overrides, "rollout=fp32"], precision=args.precision, model_impl=args.model_impl
    )
    engine = factory(source.model)
    result = {
        "config": args.config,
        "precision": args.precision,
        "batch": batch,
        **profile_engine(engine, prompts, cfg.samples, new, functions=args.functions),
    }
    write_json(args.out, result)
    print(markdown(result, args.top))
    return result


if __name__ == "__main__":
    main()
