"""Warm start: SFT the policy until its greedy accuracy is in a target band, once per machine; cached.

Why a band and not a seed
-------------------------
RL from a random tiny model sees zero reward, so every run starts from a supervised warm start on the
task's reference solutions. That SFT is chaotic: with a fixed step count, SFT seeds 0/1/2 ended at
greedy accuracy 0.957 / 0.707 / 0.176, and the same seed ended at 0.977 with one intra-op thread and
0.926 with two: reduction-order noise of the order of 1e-7 is amplified into tens of points.
A warm start defined by a seed reproduces only on the machine and thread count that built it.

So the warm start is defined by what it must achieve. With ``target_band=[low, high]`` the SFT stops
at the first evaluation whose greedy accuracy on ``eval_size`` held-out prompts lies in the band:

1. Train in segments of ``eval_every`` optimizer steps with a stable schedule (AdamW, linear warm-up
   to a moderate constant lr, global gradient-norm clipping); evaluate after each segment.
2. Accuracy in ``[low, high]``: stop, those are the weights. Below: keep a snapshot (weights and
   optimizer state) and go on. Above: the segment jumped over the band; restore the last snapshot
   below it, multiply the lr *and* the evaluation interval by ``backoff_factor`` and go on from
   there (at most ``max_backoffs`` times).
3. Every optimizer step trained counts against the ``steps`` budget (also steps undone by a
   back-off); running out, or jumping over the band more than ``max_backoffs`` times, raises
   :class:`WarmStartError` naming the band, the accuracies reached and the settings to change.

This is robust to the chaos because the stopping rule does not depend on *when* the accuracy rises,
only on the accuracy itself: a different thread count, CPU or seed moves the step at which the model
"gets" the task, not the accuracy at which it stops. The rule needs the accuracy to pass *through*
the band, i.e. to move less than the band's width between two evaluations; the stable schedule makes
that the normal case (``docs/warmstart.md`` has the measured step-to-step changes) and the back-off
makes it true where it is not (a smaller lr over fewer steps moves the accuracy less per segment). The stopping
accuracy is measured on held-out prompts (the SFT never trains on them), so it is what a greedy
validation of the returned weights reads, up to the sampling error of ``eval_size`` prompts.

Without a band (``target_band=None``) the SFT trains exactly ``steps`` steps and reports the
accuracy it reached.

Reproducibility and the cache
-----------------------------
The SFT and its evaluations run with ``num_threads`` intra-op threads (default 1) whatever the
caller uses, and the caller's setting is restored afterwards: the weights are then bit-identical for
any thread count of the run. Everything else that changes the result is in the cache key
(:func:`cache_key_payload`): the model class, config, attention implementation and *initial weights*
(their SHA-256), the tokenizer, the task class and every dataclass field, every setting, the seed, the
thread count, torch and transformers versions, the CPU capability and architecture.

A cache entry is a directory ``<cache_dir>/<key>/`` with ``policy.pt`` and ``meta.json`` (the
measured accuracy, steps, history and the key payload), each with a SHA-256 sidecar
(:mod:`ais_lightning.files`), built under a temporary name and published by one atomic rename. An
entry that is corrupt or incomplete is named in a warning, discarded and rebuilt. An exclusive lock
per key (``fcntl``, where available) makes concurrent runs (a joblib sweep) build an entry once: the
others wait and load it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ais_lightning.files import (
    CorruptFileError,
    cache_root,
    discard_dir,
    entry_lock,
    load_verified,
    make_temp_dir,
    publish_dir,
    read_text_verified,
    save_verified,
    write_text_verified,
)
from ais_lightning.models.prompting import encode_prompts
from ais_lightning.modules.sft import SFTModule, warmup_factor
from ais_lightning.policy import Policy
from ais_lightning.tasks import SOLVED_REWARD, PromptDataModule, Task, TaskSample, batch_rewards

_SFT_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(SFTModule.__init__).parameters.items()
    if param.default is not param.empty
}
"""The optimizer defaults of ``SFTModule`` (lr, warmup_steps, weight_decay, grad_clip): stated once, there."""

log = logging.getLogger(__name__)

CACHE_VERSION = 2
"""Bumped when the procedure or the entry layout changes (every older entry then misses)."""

WEIGHTS_FILE = "policy.pt"
META_FILE = "meta.json"


@dataclass
class WarmStartSettings:
    """Every setting of the supervised warm start (the schema of the ``warmstart`` config group).

    See the module docstring for the procedure. Every field except ``enabled`` and ``cache_dir`` is
    part of the cache key.
    """

    enabled: bool | str = "auto"
    """Run (or load from the cache) the warm start before RL: ``true``, ``false``, or ``auto`` (the default):
    on when the policy starts from random weights (the built-in models, which know nothing of the task), off
    for a pretrained checkpoint (``policy=local|gguf|smollm2``), which already answers and for which these
    settings, sized for the built-in model, would cost hours of SFT. ``ais-train`` settles ``auto`` from the
    policy option before anything is built (:func:`resolve_enabled`)."""
    steps: int = 500
    """With ``target_band``: the budget of optimizer steps (every step trained counts, also those undone by
    a back-off). Without: exactly this many steps."""
    batch_size: int = 128
    """Prompt/solution pairs per SFT step (also prompts per evaluation batch)."""
    lr: float = _SFT_DEFAULTS["lr"]
    """AdamW learning rate after the warm-up (constant afterwards: the stopping step is not known ahead)."""
    warmup_steps: int = _SFT_DEFAULTS["warmup_steps"]
    """Steps of linear learning-rate warm-up from ``lr / warmup_steps`` to ``lr``."""
    weight_decay: float = _SFT_DEFAULTS["weight_decay"]
    """AdamW weight decay."""
    grad_clip: float = _SFT_DEFAULTS["grad_clip"]
    """Max global gradient norm per step (0 = no clipping)."""
    target_band: list[float] | None = None
    """``[low, high]``: stop at the first evaluation whose greedy accuracy is in the band (inclusive).
    None: train exactly ``steps`` steps."""
    eval_every: int = 10
    """Optimizer steps between two evaluations of greedy accuracy (with ``target_band``)."""
    eval_size: int = 512
    """Held-out prompts the greedy accuracy is measured on (never trained on)."""
    max_new_tokens: int = 32
    """Greedy response length limit in the evaluations (match the RL validation's)."""
    max_backoffs: int = 4
    """How often a segment that jumped over the band may be retried from the last snapshot below it."""
    backoff_factor: float = 0.5
    """Multiplier of the learning rate and of the evaluation interval at each back-off, in (0, 1)."""
    num_threads: int = 1
    """Intra-op threads the SFT and its evaluations run with (the caller's setting is restored after);
    0 = the caller's current setting. Fixed, it makes the weights independent of the run's thread count."""
    seed: int | None = None
    """Data seed of the SFT (which prompts it trains and evaluates on); None = the run's seed. Note the
    initial weights are the caller's: fix the model's init seed too to share one warm start across runs."""
    cache_dir: str | None = None
    """Where warm starts are cached; None = ``$AIS_LIGHTNING_CACHE/warmstart`` or
    ``~/.cache/ais_lightning/warmstart``."""

    def __post_init__(self) -> None:
        if self.enabled not in (True, False, "auto") or not isinstance(self.enabled, (bool, str)):
            raise ValueError(f"WarmStartSettings.enabled must be true, false or auto, got {self.enabled!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_size", "max_new_tokens"):
            _check_int(self, name, minimum=1)
        for name in ("warmup_steps", "max_backoffs", "num_threads"):
            _check_int(self, name, minimum=0)
        if self.seed is not None:
            _check_int(self, "seed", minimum=None)
        for name in ("lr", "weight_decay", "grad_clip", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"WarmStartSettings.{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        if self.lr <= 0:
            raise ValueError(f"WarmStartSettings.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"WarmStartSettings.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"WarmStartSettings.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"WarmStartSettings.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.target_band is not None:
            band = list(self.target_band)  # a ListConfig or tuple from a config becomes a plain list
            if len(band) != 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in band
            ):
                raise ValueError(
                    f"WarmStartSettings.target_band must be [low, high] (two numbers) or None, got {band!r}"
                )
            low, high = float(band[0]), float(band[1])
            if not 0.0 <= low <= high <= 1.0:
                raise ValueError(
                    f"WarmStartSettings.target_band must satisfy 0 <= low <= high <= 1, got [{low}, {high}]"
                )
            self.target_band = [low, high]
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            self.cache_dir = os.fspath(self.cache_dir)

    def key_fields(self) -> dict[str, Any]:
        """The settings that change the result (all but ``enabled`` and ``cache_dir``; seed resolved apart)."""
        return {
            k: v for k, v in dataclasses.asdict(self).items() if k not in ("enabled", "cache_dir", "seed")
        }


def resolve_enabled(enabled: bool | str, starts_pretrained: bool) -> bool:
    """``WarmStartSettings.enabled`` settled for a policy: ``auto`` warm-starts only a policy that does not start
    from pretrained weights (``starts_pretrained``); ``true`` / ``false`` are kept.

    >>> resolve_enabled("auto", starts_pretrained=True), resolve_enabled("auto", starts_pretrained=False)
    (False, True)
    >>> resolve_enabled(True, starts_pretrained=True)
    True
    """
    return (not starts_pretrained) if enabled == "auto" else bool(enabled)


def _check_int(settings: WarmStartSettings, name: str, minimum: int | None) -> None:
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"WarmStartSettings.{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"WarmStartSettings.{name} must be >= {minimum}, got {value}")


@dataclass
class WarmStartResult:
    """What :func:`warm_start` did; ``policy`` holds the warm-started weights."""

    path: Path
    """The cache entry directory (``policy.pt``, ``meta.json``)."""
    from_cache: bool
    """Loaded from an existing entry (True) or trained now (False)."""
    accuracy: float
    """Greedy accuracy of the returned weights on the held-out prompts (measured when they were built)."""
    eval_size: int
    """Number of held-out prompts ``accuracy`` was measured on."""
    steps: int
    """Optimizer steps behind the returned weights."""
    steps_trained: int
    """Optimizer steps trained in all, including those undone by back-offs."""
    backoffs: int
    """Times a segment jumped over the band and was retried with a smaller lr."""
    lr: float
    """Learning rate of the segment that produced the weights (``settings.lr`` times the back-offs)."""
    key: str
    """The cache key."""
    build_time_s: float
    """Wall time of the build (of the original build for a cache hit)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Every evaluation: ``{"step", "steps_trained", "accuracy", "lr"}``."""

    def describe(self) -> str:
        """One line for logs and summaries."""
        how = "loaded from" if self.from_cache else "trained, cached in"
        backoffs = f", {self.backoffs} back-off(s)" if self.backoffs else ""
        return (
            f"greedy accuracy {self.accuracy:.3f} on {self.eval_size} held-out prompts after {self.steps} SFT "
            f"steps{backoffs}; {how} {self.path}"
        )


class WarmStartError(RuntimeError):
    """The SFT could not bring the greedy accuracy into the target band; ``history`` lists every evaluation."""

    def __init__(self, message: str, history: list[dict[str, float]] | None = None) -> None:
        super().__init__(message)
        self.history = list(history or [])


def default_cache_dir() -> Path:
    """``$AIS_LIGHTNING_CACHE/warmstart``, else ``~/.cache/ais_lightning/warmstart``."""
    return cache_root() / "warmstart"


# ------------------------------------------------------------------------------------------ cache key


def state_dict_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state dict: every entry's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer's encoding: class, vocabulary hash and special-token ids."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    blob = json.dumps(sorted(vocab.items()), default=str).encode()
    return {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "vocab_sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(tokenizer) if hasattr(tokenizer, "__len__") else len(vocab),
        "special": {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }


def task_fingerprint(task: Task) -> dict[str, Any]:
    """The task's class and every dataclass field (loaded data included, e.g. GSM8K's rows)."""
    if not (isinstance(task, Task) and dataclasses.is_dataclass(task)):
        raise ValueError(
            f"task must be an ais_lightning.tasks.Task dataclass instance, got {type(task).__qualname__}"
        )
    return {"class": f"{type(task).__module__}.{type(task).__qualname__}", "fields": dataclasses.asdict(task)}


def cache_key_payload(
    policy: Policy, tokenizer: Any, task: Task, settings: WarmStartSettings, seed: int, num_threads: int
) -> dict[str, Any]:
    """Everything the warm-started weights depend on (JSON-serializable with ``default=str``)."""
    import transformers

    config = policy.model.config
    return {
        "version": CACHE_VERSION,
        "model": {
            "class": f"{type(policy.model).__module__}.{type(policy.model).__qualname__}",
            "config": {k: v for k, v in sorted(config.to_dict().items()) if not k.startswith("_")},
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "initial_weights_sha256": state_dict_sha256(policy.model),
        },
        "tokenizer": tokenizer_fingerprint(tokenizer),
        **({"chat_template": tokenizer.chat_template} if policy.chat_template else {}),  # the prompts' format
        **({"head_dtype": "float32"} if policy.head_float32 else {}),  # the head's precision
        "task": task_fingerprint(task),
        "settings": settings.key_fields(),
        "seed": seed,
        "num_threads": num_threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def cache_key(payload: dict[str, Any]) -> str:
    """A short, stable hash of :func:`cache_key_payload`."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


# ------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def intra_op_threads(num_threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(num_threads)`` (0 = unchanged); restore it after."""
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class GreedyAccuracy:
    """Greedy accuracy of a policy on fixed prompts: the share whose task reward is >= 1.

    Responses come from the policy's fp32 engine (``policy.build_engine("fp32")``: the engine the RL
    validation uses for the trainer's precision; the LLaDA sampler for a diffusion policy) at temperature 0,
    stopped at EOS; rewards through ``batch_rewards`` (``safe_rewards``) with the
    samples' fields, like the RL validation.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        task: Task,
        samples: list[TaskSample],
        max_new_tokens: int,
        batch_size: int,
    ) -> None:
        from ais_lightning.rollout import SamplingConfig

        if not samples:
            raise ValueError("GreedyAccuracy needs at least one held-out sample")
        self.policy, self.tokenizer, self.task, self.batch_size = policy, tokenizer, task, batch_size
        self.samples = samples
        self.prompt_ids = encode_prompts(tokenizer, [s.prompt for s in samples], policy.chat_template)
        self.engine = policy.build_engine("fp32")
        self.sampling = SamplingConfig(
            n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
        )

    @torch.no_grad()
    def __call__(self) -> float:
        self.engine.sync_weights(self.policy.full_state_dict())
        correct = 0
        for start in range(0, len(self.samples), self.batch_size):
            chunk = self.samples[start : start + self.batch_size]
            out = self.engine.generate(self.prompt_ids[start : start + self.batch_size], self.sampling)
            rewards, _ = batch_rewards(self.task, chunk, out, self.tokenizer)
            correct += sum(r >= SOLVED_REWARD for r in rewards)
        return correct / len(self.samples)


@dataclass
class _Snapshot:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def _format_history(history: list[dict[str, float]], limit: int = 16) -> str:
    shown = history if len(history) <= limit else history[: limit // 2] + history[-limit // 2 :]
    parts = [f"step {int(h['step'])}: {h['accuracy']:.3f}" for h in shown]
    if len(shown) < len(history):
        parts.insert(limit // 2, "...")
    return ", ".join(parts)


def train_warm_start(
    policy: Policy,
    tokenizer: Any,
    task: Task,
    settings: WarmStartSettings,
    seed: int,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """SFT ``policy`` in place with the band-stop procedure of the module docstring; no cache, no threads.

    Returns ``{"accuracy", "steps", "steps_trained", "backoffs", "lr", "history"}``; raises
    :class:`WarmStartError` when the band is not reached. Runs with the caller's thread setting (see
    :func:`warm_start` for the fixed one) and leaves the global RNG untouched.
    """
    from tqdm import tqdm

    module = SFTModule(
        policy,
        tokenizer,
        lr=settings.lr,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        grad_clip=settings.grad_clip,
    )
    data = PromptDataModule(
        task, train_size=None, val_size=settings.eval_size, batch_size=settings.batch_size, seed=seed
    )
    held_out = data.val_samples()  # the train stream redraws any prompt that is one of these
    stream = data.train_stream()
    evaluate = GreedyAccuracy(policy, tokenizer, task, held_out, settings.max_new_tokens, settings.batch_size)
    optimizer = module.build_optimizer()
    band = settings.target_band
    per_epoch = stream.batches_per_epoch
    history: list[dict[str, float]] = []
    lr, interval, step, trained, backoffs = settings.lr, settings.eval_every, 0, 0, 0

    def record(accuracy: float) -> None:
        history.append({"step": step, "steps_trained": trained, "accuracy": accuracy, "lr": lr})
        bar.set_postfix(step=step, acc=f"{accuracy:.3f}", lr=f"{lr:.2g}")

    def train(n: int) -> None:
        nonlocal step, trained
        for _ in range(n):
            batch = stream.batch(step // per_epoch, step % per_epoch)  # batch k of the trajectory
            module.train_step(optimizer, batch, lr * warmup_factor(step, settings.warmup_steps))
            step, trained = step + 1, trained + 1
            bar.update(1)

    def outcome(accuracy: float) -> dict[str, Any]:
        return {
            "accuracy": accuracy,
            "steps": step,
            "steps_trained": trained,
            "backoffs": backoffs,
            "lr": lr,
            "history": history,
        }

    was_training = policy.training
    policy.train()
    bar = tqdm(total=settings.steps, desc="warm start", disable=not progress_bar, leave=False)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if band is None:
                train(settings.steps)
                accuracy = evaluate()
                record(accuracy)
                return outcome(accuracy)
            low, high = band
            accuracy = evaluate()
            record(accuracy)
            if accuracy > high:
                raise WarmStartError(
                    f"the policy's greedy accuracy is {accuracy:.3f} before any SFT, above target_band "
                    f"[{low}, {high}]; SFT only raises it: raise warmstart.target_band or disable the warm start",
                    history,
                )
            snapshot = _Snapshot(0, copy.deepcopy(policy.state_dict()), copy.deepcopy(optimizer.state_dict()))
            while not low <= accuracy <= high:
                if trained >= settings.steps:
                    raise WarmStartError(
                        f"the warm start did not reach target_band [{low}, {high}] within steps={settings.steps} "
                        f"optimizer steps ({backoffs} back-off(s), best greedy accuracy "
                        f"{max(h['accuracy'] for h in history):.3f}; on {settings.eval_size} held-out prompts: "
                        f"{_format_history(history)}). Raise warmstart.steps or warmstart.lr, or lower "
                        "warmstart.target_band.",
                        history,
                    )
                previous = accuracy
                train(min(interval, settings.steps - trained))
                accuracy = evaluate()
                record(accuracy)
                if accuracy > high:
                    if backoffs >= settings.max_backoffs:
                        raise WarmStartError(
                            f"the warm start jumped over target_band [{low}, {high}] {backoffs + 1} times, last "
                            f"from {previous:.3f} to {accuracy:.3f} within {interval} steps at lr "
                            f"{lr:.3g} (greedy accuracy on {settings.eval_size} held-out prompts: "
                            f"{_format_history(history)}). Lower warmstart.eval_every or warmstart.lr, raise "
                            "warmstart.max_backoffs, or widen warmstart.target_band.",
                            history,
                        )
                    backoffs += 1
                    log.info(
                        "warm start: accuracy %.3f -> %.3f jumped over [%s, %s]; back to step %d with lr %.3g",
                        previous, accuracy, low, high, snapshot.step, lr * settings.backoff_factor,
                    )  # fmt: skip
                    policy.load_state_dict(snapshot.model)
                    optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
                    step, lr = snapshot.step, lr * settings.backoff_factor
                    interval = max(1, round(interval * settings.backoff_factor))
                    accuracy = previous
                elif accuracy < low:
                    snapshot = _Snapshot(
                        step, copy.deepcopy(policy.state_dict()), copy.deepcopy(optimizer.state_dict())
                    )
            return outcome(accuracy)
    finally:
        bar.close()
        policy.train(was_training)
        optimizer.zero_grad(set_to_none=True)


def _read_entry(entry: Path, key: str, policy: Policy) -> dict[str, Any] | None:
    """The metadata of a valid entry after loading its weights into ``policy``; None if absent.

    A corrupt or incomplete entry is named in a warning and discarded (the caller rebuilds it).
    """
    if not entry.exists():
        return None
    try:
        meta = json.loads(read_text_verified(entry / META_FILE))
        if not isinstance(meta, dict) or meta.get("key") != key:
            raise CorruptFileError(entry / META_FILE, f"does not describe cache key {key}")
        for name in ("accuracy", "steps", "steps_trained", "backoffs", "lr", "eval_size"):
            if not isinstance(meta.get(name), (int, float)):
                raise CorruptFileError(entry / META_FILE, f"has no number {name!r}")
        state = load_verified(entry / WEIGHTS_FILE)
        expected = policy.model.state_dict()
        if not isinstance(state, dict) or set(state) != set(expected):
            raise CorruptFileError(entry / WEIGHTS_FILE, "does not hold this model's state dict")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape) or tensor.dtype != expected[name].dtype:
                raise CorruptFileError(entry / WEIGHTS_FILE, f"tensor {name!r} has the wrong shape or dtype")
    except (CorruptFileError, ValueError, RuntimeError, OSError, EOFError) as err:
        log.warning(
            "warm-start cache entry %s is corrupt or incomplete (%s); discarding and rebuilding it",
            entry,
            err,
        )
        discard_dir(entry)
        return None
    policy.model.load_state_dict(state)
    return meta


def _write_entry(root: Path, key: str, policy: Policy, meta: dict[str, Any]) -> Path:
    """Write the entry under a temporary name and publish it as ``root/key`` (atomic rename)."""
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    tmp = make_temp_dir(root, key)
    try:
        save_verified(policy.model.state_dict(), tmp / WEIGHTS_FILE)
        write_text_verified(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True, default=str))
        publish_dir(tmp, entry)
    except BaseException:
        discard_dir(tmp)
        raise
    return entry


def warm_start(
    policy: Policy,
    tokenizer: Any,
    task: Task,
    settings: WarmStartSettings,
    *,
    seed: int,
    progress_bar: bool = True,
) -> WarmStartResult:
    """Warm-start ``policy`` in place on ``task`` (SFT to the target band), or load the cached result.

    Args:
        policy: the policy to train; its current weights are the starting point (and part of the key).
        tokenizer: the policy's tokenizer (None: ``policy.tokenizer``).
        task: an ``ais_lightning.tasks.Task`` dataclass instance (its reference solutions are the SFT data).
        settings: every warm-start setting (see :class:`WarmStartSettings`).
        seed: the run's seed; the SFT uses ``settings.seed`` when that is set.
        progress_bar: show a progress bar while training.

    Returns:
        A :class:`WarmStartResult` (cache path, whether it was a cache hit, the measured accuracy...).

    Raises:
        WarmStartError: the target band was not reached (the policy is then left partly trained).
    """
    if not isinstance(settings, WarmStartSettings):
        raise ValueError(f"settings must be a WarmStartSettings, got {type(settings).__name__}")
    if tokenizer is None:
        tokenizer = policy.tokenizer
        if tokenizer is None:
            raise ValueError("warm_start needs a tokenizer (none given and policy.tokenizer is None)")
    sft_seed = seed if settings.seed is None else settings.seed
    threads = settings.num_threads or torch.get_num_threads()
    payload = cache_key_payload(policy, tokenizer, task, settings, sft_seed, threads)
    key = cache_key(payload)
    root = Path(settings.cache_dir) if settings.cache_dir else default_cache_dir()
    with entry_lock(root, key, "warm start"):
        meta = _read_entry(root / key, key, policy)
        if meta is not None:
            return _result(root / key, True, meta)
        started = time.perf_counter()
        with intra_op_threads(threads):
            out = train_warm_start(policy, tokenizer, task, settings, sft_seed, progress_bar)
        meta = {
            "key": key,
            **out,
            "eval_size": settings.eval_size,
            "build_time_s": time.perf_counter() - started,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "payload": payload,
        }
        entry = _write_entry(root, key, policy, meta)
    return _result(entry, False, meta)


def _result(entry: Path, from_cache: bool, meta: dict[str, Any]) -> WarmStartResult:
    return WarmStartResult(
        path=entry,
        from_cache=from_cache,
        accuracy=float(meta["accuracy"]),
        eval_size=int(meta["eval_size"]),
        steps=int(meta["steps"]),
        steps_trained=int(meta["steps_trained"]),
        backoffs=int(meta["backoffs"]),
        lr=float(meta["lr"]),
        key=str(meta["key"]),
        build_time_s=float(meta.get("build_time_s", float("nan"))),
        history=list(meta.get("history", [])),
    )
