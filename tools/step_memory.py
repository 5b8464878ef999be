"""Where the time and the memory of a GRPO step go: ``ais-train``'s own loop, phase by phase, one process.

The run is assembled as ``ais-train`` assembles it (``ais_lightning.app.build.validate`` of the composed config:
policy, engines, corrector, loss, task, settings; ``GRPOModule``, ``PromptDataModule``; a Lightning Trainer
of one CPU process, no logger and no checkpoint). It validates once before training (as ``ais-train``
does) and once after the last step, and times each phase by wrapping the method that runs it on the
module, its policy, its optimizer and its engines (the loop itself is not changed):

- ``engines build``: the engines' private copies of the model (``GRPOModule._build_engine``);
- ``rollout``: ``engine.generate`` of a training step; ``score``: rewards;
- ``log-prob``: the policy's log-prob pass (with autograd when the loss reuses it);
- ``backward``, ``clip`` (gradient norm), ``optimizer`` (AdamW's step);
- ``state dict`` (``policy.full_state_dict``: the full weights copied out for the engines) and
  ``sync load`` (``engine.sync_weights``): together the weight sync;
- ``validation``: one validation batch (both engines' greedy generations and their scoring).

For each phase: how often it ran, its seconds (median per call), the resident set size at its start and
its peak during the phase (sampled every 2 ms, ``ais_lightning.toolkit.measure.PeakRSS``), all measured with
whatever else runs on the machine (the 1-minute load average is reported). RSS only grows when the
allocator needs new pages, so a phase's growth counts what it needs beyond what earlier phases left
free. Beside the phases, an exact inventory of what stays resident between steps: the policy's
parameters and gradients, AdamW's state, each engine's copy (distinct tensor storages, counted once).

    python tools/step_memory.py policy=smollm2 task=arithmetic warmstart=disabled rollout=fp32 \\
        trainer.max_steps=3 algorithm.prompts_per_step=4 algorithm.group_size=4 algorithm.max_new_tokens=32 \\
        algorithm.val_size=8 --threads 2 --json step_memory.json
    python tools/step_memory.py experiment=smoke warmstart=disabled trainer.max_steps=2   # the tiny model
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ais_lightning.toolkit.measure import PeakRSS, rss_bytes

MB = 2**20
PHASES = (
    "engines build",
    "rollout",
    "score",
    "log-prob",
    "backward",
    "clip",
    "optimizer",
    "state dict",
    "sync load",
    "validation",
)
"""The phases in the order a run meets them (the table's rows)."""


class PhaseMeter:
    """Times calls and samples the RSS during them, by phase name; nested calls are charged to the outer one."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict[str, float]]] = {}
        self._active = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` measured as one call of phase ``name`` (not when called inside another measured phase)."""

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                return fn(*args, **kwargs)
            self._active += 1
            try:
                with PeakRSS() as mem:
                    start, cpu = time.perf_counter(), time.process_time()
                    out = fn(*args, **kwargs)
                    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            finally:
                self._active -= 1
            self.calls.setdefault(name, []).append(
                {
                    "seconds": seconds,
                    "cpu_s": cpu,
                    "rss_start_mb": mem.base / MB,
                    "rss_peak_mb": mem.peak / MB,
                    "rss_end_mb": rss_bytes() / MB,
                }
            )
            return out

        return measured

    def patch(self, owner: Any, attribute: str, name: str) -> None:
        """Replace ``owner.attribute`` (a method of its class) by its measured version, on this instance only.

        The wrapper holds ``owner`` weakly: a bound method stored on its own instance would be a reference
        cycle, keeping e.g. a replaced engine's copy of the model alive until the garbage collector runs.
        """
        method, owner_ref = getattr(type(owner), attribute), weakref.ref(owner)
        setattr(owner, attribute, self.wrap(name, lambda *a, **k: method(owner_ref(), *a, **k)))


def storage_mb(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> float:
    """MB of the distinct storages behind ``tensors`` (shared storages, e.g. tied weights, counted once)."""
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total / MB


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def inventory(module: Any) -> dict[str, float]:
    """Exact MB of what stays resident between steps: weights, gradients, AdamW state, the engines' copies."""
    policy = module.policy
    optimizer = module.optimizers().optimizer if module._trainer is not None else None
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "policy weights": storage_mb(_tensors(policy)),
        "gradients": storage_mb(p.grad for p in policy.parameters() if p.grad is not None),
        "optimizer state": storage_mb(state),
    }
    engine, eval_engine = getattr(module, "engine", None), getattr(module, "eval_engine", None)
    for name, value in (("engine", engine), ("eval engine", eval_engine)):
        if name == "eval engine" and value is engine:
            out["eval engine copy (the engine's)"] = 0.0
        elif value is not None and isinstance(getattr(value, "model", None), torch.nn.Module):
            out[f"{name} copy"] = storage_mb(_tensors(value.model))
    if getattr(module, "reference", None) is not None:
        out["reference copy"] = storage_mb(_tensors(module.reference))
    return out


def live_tensors_mb() -> float:
    """MB of the distinct storages of every tensor the garbage collector can reach (what is really alive;
    the rest of the RSS is the allocator's free memory, the libraries and the interpreter)."""
    import gc
    import warnings

    with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    return storage_mb(tensors)


def _callback(meter: PhaseMeter, snapshots: list[dict[str, Any]]) -> Any:
    from lightning import Callback

    class StepSnapshots(Callback):
        """The RSS and the resident inventory at the end of each training step, and the step's wall time."""

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            snapshots.append(
                {
                    "step": len(snapshots) + 1,
                    "step_s": time.perf_counter() - self._start,
                    "rss_mb": rss_bytes() / MB,
                    "inventory_mb": inventory(module),
                    "live_tensors_mb": live_tensors_mb(),
                    "load_avg_1min": os.getloadavg()[0],
                }
            )

    return StepSnapshots()


def instrument(module: Any, meter: PhaseMeter) -> None:
    """Wrap the methods that run each phase on ``module`` (a ``GRPOModule``), its policy and, as they are
    built, its engines and optimizer."""
    meter.patch(module, "score", "score")
    meter.patch(module, "manual_backward", "backward")
    meter.patch(module, "_grad_norm", "clip")
    meter.patch(module, "validation_step", "validation")
    meter.patch(module.policy, "batch_logprobs", "log-prob")
    meter.patch(module.policy, "full_state_dict", "state dict")
    build_engine = meter.wrap(
        "engines build", functools.partial(type(module)._build_engine, weakref.proxy(module))
    )

    def build_and_instrument(*args: Any, **kwargs: Any) -> Any:
        engine = build_engine(*args, **kwargs)
        meter.patch(engine, "generate", "rollout")
        meter.patch(engine, "sync_weights", "sync load")
        return engine

    module._build_engine = build_and_instrument
    configure, module_ref = type(module).configure_optimizers, weakref.ref(module)

    def configure_and_instrument() -> Any:
        optimizer = configure(module_ref())
        meter.patch(optimizer, "step", "optimizer")
        return optimizer

    module.configure_optimizers = configure_and_instrument


def run(overrides: list[str], threads: int | None, validate_before: bool = True) -> dict[str, Any]:
    """Train the composed config's ``trainer.max_steps`` steps with every phase measured (one process)."""
    import lightning as L

    import ais_lightning
    from ais_lightning.toolkit.probes import compose, one_process

    cfg, c = compose(overrides)
    one_process(c, "step_memory", warm_start=False, threads=threads)
    rss = {"start": rss_bytes() / MB}
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy = c.policy.build(cfg.seed)
    rss["policy built"] = rss_bytes() / MB
    module = c.grpo_module(policy, cfg.seed)
    meter = PhaseMeter()
    instrument(module, meter)
    steps = c.trainer.max_steps
    data = c.prompt_data(steps, cfg.seed)
    snapshots: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="step_memory_") as root, PeakRSS() as whole:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision=c.trainer.precision,
            max_steps=steps * c.algorithm.optimizer_steps_per_rollout,
            val_check_interval=steps,  # one validation, after the last step
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[_callback(meter, snapshots)],
            default_root_dir=root,
        )
        if validate_before:
            trainer.validate(module, datamodule=data, verbose=False)
        trainer.fit(module, datamodule=data)
    linear = sum(m.weight.numel() for m in policy.modules() if isinstance(m, torch.nn.Linear))
    return {
        "overrides": overrides,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "rows": c.algorithm.prompts_per_step * c.algorithm.group_size,
        "max_new_tokens": c.algorithm.max_new_tokens,
        "val_size": c.algorithm.val_size,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "linear_params": linear,
        "rss_mb": {**rss, "peak": whole.peak / MB},
        "wall_s": time.perf_counter() - started,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "phases": meter.calls,
        "step_snapshots": snapshots,
        "package": str(Path(ais_lightning.__file__).parent),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }


def phase_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase that ran: calls, median and total seconds, the highest start and peak RSS."""
    rows = []
    names = [p for p in PHASES if p in result["phases"]] + sorted(set(result["phases"]) - set(PHASES))
    for name in names:
        calls = result["phases"][name]
        top = max(calls, key=lambda x: x["rss_peak_mb"])
        rows.append(
            {
                "phase": name,
                "calls": len(calls),
                "seconds_median": statistics.median(x["seconds"] for x in calls),
                "seconds_total": sum(x["seconds"] for x in calls),
                "cpu_s_median": statistics.median(x["cpu_s"] for x in calls),
                "rss_start_mb": top["rss_start_mb"],
                "rss_peak_mb": top["rss_peak_mb"],
                "growth_mb": max(x["rss_peak_mb"] - x["rss_start_mb"] for x in calls),
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    load = result["load_avg_1min"]
    lines = [
        f"{result['parameters'] / 1e6:.1f}M parameters, {result['rows']} rows x {result['max_new_tokens']} new "
        f"tokens per step, {result['steps']} steps, {result['val_size']} validation prompts, "
        f"{result['threads']} threads; 1-min load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores; "
        f"peak RSS {result['rss_mb']['peak']:.0f} MB (policy built: {result['rss_mb']['policy built']:.0f} MB)",
        "",
        "| phase | calls | s per call (median) | CPU s per call (median) | s total | RSS at start MB "
        "| peak RSS MB | growth MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in phase_rows(result):
        lines.append(
            f"| {r['phase']} | {r['calls']} | {r['seconds_median']:.2f} | {r['cpu_s_median']:.2f} "
            f"| {r['seconds_total']:.2f} | {r['rss_start_mb']:.0f} | {r['rss_peak_mb']:.0f} | {r['growth_mb']:.0f} |"
        )
    if result["step_snapshots"]:
        last = result["step_snapshots"][-1]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in last["inventory_mb"].items())
        steps = ", ".join(f"{s['step_s']:.1f}" for s in result["step_snapshots"])
        lines += ["", f"resident after the last step (MB, exact): {parts}; all live tensors "
                  f"{last['live_tensors_mb']:.0f}; RSS {last['rss_mb']:.0f} MB",
                  f"step wall times (s): {steps}"]  # fmt: skip
    return "\n".join(lines)


def rollout_shaped_batch(overrides: list[str]) -> tuple[Any, Any, tuple[torch.Tensor, ...]]:
    """The policy of the composed config, its algorithm settings, and a batch of its rollout's shape: the first
    training batch's prompts as the policy encodes them (left-padded), ``group_size`` rows each, with
    ``max_new_tokens`` response tokens drawn from the vocabulary, all valid (the longest a rollout can be)."""
    from ais_lightning.toolkit.probes import compose

    cfg, c = compose(overrides)
    policy = c.policy.build(cfg.seed)
    data = c.prompt_data(1, cfg.seed)
    data.setup("fit")
    prompts = policy.encode_prompts(next(iter(data.train_dataloader()))["prompt"])
    algo = c.algorithm
    rows, width = len(prompts) * algo.group_size, max(len(p) for p in prompts)
    prompt_ids = torch.zeros((rows, width), dtype=torch.long)
    for i, ids in enumerate(prompts):
        prompt_ids[i * algo.group_size : (i + 1) * algo.group_size, width - len(ids) :] = torch.tensor(ids)
    prompt_mask = torch.zeros_like(prompt_ids, dtype=torch.bool)
    for i, ids in enumerate(prompts):
        prompt_mask[i * algo.group_size : (i + 1) * algo.group_size, width - len(ids) :] = True
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(cfg.seed)
    response = torch.randint(0, vocab, (rows, algo.max_new_tokens), generator=gen)
    return policy, algo, (prompt_ids, prompt_mask, response, torch.ones_like(response, dtype=torch.bool))


def update_split(overrides: list[str], threads: int | None, repeats: int) -> dict[str, Any]:
    """What the update would cost if no weight of the body were trained (LoRA's lower bound), on one batch.

    ``full``: the update as GRPO runs it at one optimizer step per rollout (the log-prob pass with autograd,
    entropies values only, its backward, AdamW over every parameter). ``frozen``: the same pass and
    backward with every weight frozen and the embedding output requiring grad, so backward still runs through
    every layer (the input gradients a LoRA adapter in each layer needs) but computes no weight gradient and
    no optimizer step: what training small adapters could at best save (the adapters' own cost left out).
    Alternating, ``repeats`` times each after one warm-up; CPU and wall seconds.
    """
    if threads:
        torch.set_num_threads(threads)
    policy, algo, batch = rollout_shaped_batch(overrides)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=algo.lr)
    embed = policy.model.get_input_embeddings()

    def full() -> None:
        out = policy.response_logprobs(*batch, compute_entropy=True, entropy_grad=False)
        out.logprobs.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def frozen() -> None:
        policy.requires_grad_(False)
        hook = embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
        try:
            out = policy.response_logprobs(*batch, compute_entropy=True, entropy_grad=False)
            out.logprobs.sum().backward()
        finally:
            hook.remove()
            for p in params:
                p.requires_grad_(True)

    runs: dict[str, list[dict[str, float]]] = {"full": [], "frozen": []}
    for r in range(repeats + 1):
        for name in ("full", "frozen") if r % 2 == 0 else ("frozen", "full"):
            start, cpu = time.perf_counter(), time.process_time()
            {"full": full, "frozen": frozen}[name]()
            if r:  # the first round warms up the allocator and the kernels
                runs[name].append(
                    {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
                )
    ratios = [f["cpu_s"] / b["cpu_s"] for f, b in zip(runs["frozen"], runs["full"])]
    return {
        "overrides": overrides,
        "threads": torch.get_num_threads(),
        "batch": {
            "rows": batch[0].shape[0],
            "prompt_tokens": batch[0].shape[1],
            "response_tokens": batch[2].shape[1],
        },
        "runs": runs,
        "median": {
            k: {m: statistics.median(x[m] for x in v) for m in ("seconds", "cpu_s")} for k, v in runs.items()
        },
        "frozen_over_full_cpu": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "load_avg_1min": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ais_lightning.toolkit.probes import add_overrides_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--no-validate-before", action="store_true", help="skip the validation before training"
    )
    parser.add_argument("--json", default=None, help="write the result (every call of every phase) here")
    parser.add_argument(
        "--update-split",
        type=int,
        default=0,
        metavar="REPEATS",
        help="instead of a run: time the update with every weight trained vs frozen (LoRA's bound), REPEATS times",
    )
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)

    from ais_lightning.toolkit.probes import quiet_run_logs, write_json

    quiet_run_logs()
    if args.update_split:
        result = update_split(args.overrides, args.threads, args.update_split)
        write_json(args.json, result)
        med, ratio = result["median"], result["frozen_over_full_cpu"]
        print(
            f"{result['batch']}, {result['threads']} threads, load {result['load_avg_1min']:.1f}: update with every "
            f"weight trained {med['full']['cpu_s']:.2f} CPU s ({med['full']['seconds']:.2f} s), frozen weights "
            f"{med['frozen']['cpu_s']:.2f} CPU s ({med['frozen']['seconds']:.2f} s): {ratio['median']:.2f}x "
            f"({ratio['min']:.2f}-{ratio['max']:.2f})"
        )
        return result
    result = run(args.overrides, args.threads, validate_before=not args.no_validate_before)
    result["rows_table"] = phase_rows(result)
    write_json(args.json, result)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
