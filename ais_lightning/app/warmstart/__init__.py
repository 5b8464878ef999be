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
per key (``filelock``) makes concurrent runs (a joblib sweep) build an entry once: the
others wait and load it.

Modules, one job each
---------------------
``settings`` (:class:`WarmStartSettings`), ``key`` (the cache key), ``cache`` (entries on disk), ``evaluate``
(:class:`GreedyAccuracy`), ``search`` (the band search, :func:`train_warm_start`), ``threads`` (the fixed thread
count) and ``run`` (:func:`warm_start`, which puts them together); every public name is importable from here.
"""

from ais_lightning.app.warmstart.cache import default_cache_dir
from ais_lightning.app.warmstart.evaluate import GreedyAccuracy
from ais_lightning.app.warmstart.key import (
    CACHE_VERSION,
    cache_key,
    cache_key_payload,
    state_dict_sha256,
    task_fingerprint,
    tokenizer_fingerprint,
)
from ais_lightning.app.warmstart.run import WarmStartResult, warm_start
from ais_lightning.app.warmstart.search import WarmStartError, train_warm_start
from ais_lightning.app.warmstart.settings import WarmStartSettings, resolve_enabled
from ais_lightning.app.warmstart.threads import intra_op_threads

# The public path: configs name it as the warmstart group's _target_ (ais_lightning.app.config.target_path).
WarmStartSettings.__module__ = __name__

__all__ = [
    "CACHE_VERSION",
    "GreedyAccuracy",
    "WarmStartError",
    "WarmStartResult",
    "WarmStartSettings",
    "cache_key",
    "cache_key_payload",
    "default_cache_dir",
    "intra_op_threads",
    "resolve_enabled",
    "state_dict_sha256",
    "task_fingerprint",
    "tokenizer_fingerprint",
    "train_warm_start",
    "warm_start",
]
