"""Measures of the tools under ``tools/``, each defined once: the wall time of a call, the peak resident memory of a
block of code, the greedy accuracy and the sampled reward of a rollout engine on a task, and the mismatch between a
policy and an engine on the tokens the engine sampled (the k3 KL with its prompt-clustered standard error, from the AIS
corrector's own sufficient statistics)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def timed(run: Callable[[], None]) -> float:
    """Seconds ``run()`` took (wall time, ``time.perf_counter``)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager sampling RSS in a thread (every 2 ms); ``.peak_delta`` = max RSS - RSS at entry (bytes).

    RSS only grows when the allocator needs new pages, so memory reused from earlier work is not counted.
    """

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.peak_delta = self.peak - self.base


def stop_tokens(tokenizer: Any) -> list[int]:
    """The stop token ids of a tokenizer's responses: its EOS, if it has one."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def sampling_config(
    tokenizer: Any, n: int, temperature: float, max_new_tokens: int, seed: int | None = None
) -> Any:
    """The ``SamplingConfig`` of a measurement: ``n`` samples per prompt at ``temperature`` (0: greedy), at most
    ``max_new_tokens``, stopped at the tokenizer's EOS (:func:`stop_tokens`), seeded by ``seed``."""
    from ais_lightning.rollout import SamplingConfig

    return SamplingConfig(
        n=n,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_tokens(tokenizer),
        seed=seed,
    )


def greedy_accuracy(
    policy: Any, engine: Any, task: Any, samples: Sequence[Any], max_new_tokens: int, seed: int | None = None
) -> float:
    """The share of ``samples`` that ``engine`` answers right greedily (temperature 0, stopped at EOS).

    Prompts as the policy encodes them (its chat template included); rewards through
    ``ais_lightning.tasks.batch_rewards`` and counted by ``ais_lightning.tasks.accuracy`` (reward >=
    ``SOLVED_REWARD``), as the RL validation counts them. ``seed``: the sampling seed (a diffusion engine's random
    remasking draws positions even when greedy).
    """
    from ais_lightning.tasks import accuracy, batch_rewards

    greedy = sampling_config(policy.tokenizer, 1, 0.0, max_new_tokens, seed)
    batch = engine.generate(policy.encode_prompts([s.prompt for s in samples]), greedy)
    return accuracy(batch_rewards(task, samples, batch, policy.tokenizer)[0])


def sampled_reward(task: Any, samples: Sequence[Any], batch: Any, tokenizer: Any) -> float:
    """The mean task reward of every row of a ``RolloutBatch`` (``ais_lightning.tasks.batch_rewards``)."""
    from ais_lightning.tasks import batch_rewards

    rewards = batch_rewards(task, samples, batch, tokenizer)[0]
    return sum(rewards) / len(rewards)


def score_samples(
    policy: Any, engine: Any, samples: Sequence[Any], sampling: Any
) -> tuple[Any, torch.Tensor]:
    """``engine`` samples the prompts of ``samples`` with ``sampling``; returns the ``RolloutBatch`` and the
    policy's log pi of the sampled tokens at the sampling temperature (``Policy.batch_logprobs``).  # [B, T]"""
    batch = engine.generate(policy.encode_prompts([s.prompt for s in samples]), sampling)
    with torch.no_grad():
        pi = policy.batch_logprobs(batch, temperature=sampling.temperature).logprobs
    return batch, pi


def _prompt_rows(
    x: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` rows joined per prompt into one row each: ``[P, G * T]`` (``G`` the most rows of a prompt, the
    rest masked), in the order of ``prompt_index``'s values."""
    order = torch.argsort(prompt_index, stable=True)
    index = prompt_index[order]
    counts = torch.bincount(index)  # [P]
    prompts, group, width = counts.numel(), int(counts.max()), x.shape[1]
    slot = (
        torch.arange(index.numel()) - (torch.cumsum(counts, 0) - counts)[index]
    )  # row's place in its prompt
    joined = x.new_zeros(prompts, group, width)
    joined_mask = torch.zeros(prompts, group, width, dtype=torch.bool)
    joined[index, slot] = x[order]
    joined_mask[index, slot] = mask[order]
    return joined.reshape(prompts, group * width), joined_mask.reshape(prompts, group * width)


def clustered_kl(
    pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor
) -> tuple[float, float]:
    """Token-mean k3 KL(mu || pi) and its standard error with the tokens of one prompt as one cluster.

    ``pi``, ``mu``: ``[B, T]`` log-probs; ``mask``: ``[B, T]`` bool; ``prompt_index``: ``[B]`` prompt of each row.
    The AIS corrector's own estimator: ``ais_sufficient_statistics`` and ``ais_coefficient``'s ``kl_k3`` and its
    clustered ``kl_k3_se``, with the rows of each prompt joined into one response, so the clusters are the prompts
    (the samples of one prompt are not independent). With ``s_p`` the k3 sum and ``n_p`` the token count of prompt
    ``p`` (of ``P`` prompts with tokens): ``KL = sum s_p / sum n_p`` (``MismatchKL("k3")``'s estimate, the same
    clamp of the log-ratio) and ``s.e. = sqrt(P / (P - 1) * sum_p (s_p - KL n_p)^2) / sum_p n_p`` (the ratio
    estimator's linearised s.e.); ``(0.0, nan)`` without a valid token.
    """
    from ais_lightning.correctors.ais import ais_coefficient, ais_params, ais_sufficient_statistics
    from ais_lightning.ops import log_ratio

    delta, joined_mask = _prompt_rows(log_ratio(pi, mu, mask), mask, prompt_index)  # [P, G * T]
    stats = ais_sufficient_statistics(delta, joined_mask, torch.ones_like(delta))
    if float(stats[0]) == 0:  # no valid token
        return 0.0, float("nan")
    out = ais_coefficient(stats, ais_params())
    return float(out["kl_k3"]), float(out["kl_k3_se"])


def mismatch(
    pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor
) -> dict[str, float]:
    """The mismatch of the sampled tokens between the trainer (log ``pi``) and the engine (log ``mu``), ``[B, T]``.

    ``kl_k3``: ``MismatchKL("k3")`` (the token mean logged in training) with ``kl_k3_se``, its standard error over
    prompts (:func:`clustered_kl`); ``kl_k1``: ``MismatchKL("k1")``; ``max_abs_dlogp``: the largest
    ``|log pi - log mu|`` over valid tokens; ``tokens``: how many are valid.
    """
    from ais_lightning.diagnostics import MismatchKL

    k3, k1 = MismatchKL("k3"), MismatchKL("k1")
    k3.update(pi, mu, mask)
    k1.update(pi, mu, mask)
    any_valid = bool(mask.any())
    return {
        "kl_k3": float(k3.compute()),
        "kl_k3_se": clustered_kl(pi, mu, mask, prompt_index)[1],
        "kl_k1": float(k1.compute()),
        "max_abs_dlogp": float((pi - mu)[mask].abs().max()) if any_valid else 0.0,
        "tokens": int(mask.sum()),
    }
