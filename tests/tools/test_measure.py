"""The tools' shared measures and run builder: ``ais_lightning.toolkit.measure`` (the clustered KL from the AIS
corrector's statistics, the mismatch row, greedy accuracy) and ``ais_lightning.toolkit.probes`` (overrides, compose,
engine factories, a policy carrying another's weights)."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.diagnostics import MismatchKL
from ais_lightning.toolkit.measure import (
    clustered_kl,
    greedy_accuracy,
    mismatch,
    sampled_reward,
    score_samples,
)
from ais_lightning.toolkit.probes import compose, engine_factory, override, policy_like, training_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _logprobs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(6, 5, generator=g) * 3  # [B, T]
    pi = mu + 0.3 * torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    return pi, mu, mask


def test_clustered_kl_is_the_token_mean_with_a_ratio_standard_error():
    pi, mu, mask = _logprobs()
    prompt = torch.tensor([0, 0, 1, 1, 2, 2])
    kl, se = clustered_kl(pi, mu, mask, prompt)
    metric = MismatchKL("k3")
    metric.update(pi, mu, mask)
    assert kl == pytest.approx(float(metric.compute()), rel=1e-6)
    # by hand: per-prompt k3 sums s_p over n_p tokens
    d = (pi - mu).double()
    k3 = torch.where(mask, torch.expm1(d) - d, torch.zeros_like(d))
    s = [float(k3[2 * p : 2 * p + 2].sum()) for p in range(3)]
    n = [float(mask[2 * p : 2 * p + 2].sum()) for p in range(3)]
    ratio = sum(s) / sum(n)
    expected = math.sqrt(3 / 2 * sum((sp - ratio * npp) ** 2 for sp, npp in zip(s, n))) / sum(n)
    assert se == pytest.approx(expected, rel=1e-9)
    assert clustered_kl(mu, mu, mask, prompt) == (0.0, 0.0)  # pi = mu
    kl_none, se_none = clustered_kl(pi, mu, torch.zeros_like(mask), prompt)
    assert kl_none == 0.0 and math.isnan(se_none)


def test_clustered_kl_groups_rows_by_prompt_in_any_order():
    pi, mu, mask = _logprobs(1)
    prompt = torch.tensor([0, 0, 1, 1, 2, 2])
    order = torch.tensor([4, 1, 2, 0, 5, 3])  # rows of a prompt apart, prompts interleaved
    assert clustered_kl(pi[order], mu[order], mask[order], prompt[order]) == pytest.approx(
        clustered_kl(pi, mu, mask, prompt), rel=1e-12
    )
    # one row per prompt: the clusters are the responses, the AIS corrector's own kl_k3_se
    from ais_lightning.correctors.ais import ais_coefficient, ais_params, ais_sufficient_statistics
    from ais_lightning.ops import log_ratio

    delta = log_ratio(pi, mu, mask)
    stats = ais_sufficient_statistics(delta, mask, torch.ones_like(delta))
    expected = ais_coefficient(stats, ais_params())
    kl, se = clustered_kl(pi, mu, mask, torch.arange(6))
    assert (kl, se) == pytest.approx((float(expected["kl_k3"]), float(expected["kl_k3_se"])), rel=1e-12)


def test_mismatch_row():
    pi, mu, mask = _logprobs()
    prompt = torch.tensor([0, 0, 1, 1, 2, 2])
    row = mismatch(pi, mu, mask, prompt)
    k1 = MismatchKL("k1")
    k1.update(pi, mu, mask)
    assert row["kl_k1"] == pytest.approx(float(k1.compute()))
    assert row["kl_k3_se"] == clustered_kl(pi, mu, mask, prompt)[1]
    assert row["max_abs_dlogp"] == pytest.approx(float((pi - mu)[mask].abs().max()))
    assert row["tokens"] == int(mask.sum())


def test_override_strings():
    assert override("warmstart.target_band", None) == "warmstart.target_band=null"
    assert override("warmstart.target_band", [0.65, 0.75]) == "warmstart.target_band=[0.65,0.75]"
    assert override("policy.router_replay", True) == "policy.router_replay=true"
    assert override("policy.path", "/tmp/a b") == "policy.path='/tmp/a b'"
    assert override("policy.path", "/tmp/ws") == "policy.path=/tmp/ws"
    _, c = compose([override("warmstart.cache_dir", "/tmp/it's here"), "warmstart.enabled=false"])
    assert c.warmstart.cache_dir == "/tmp/it's here"


def test_the_builder_path_of_a_tool():
    """Policy, task and engines of the composed config; an engine built as training builds it is the policy
    itself at fp32; a policy under another option carries the same weights."""
    overrides = ["warmstart=disabled", "algorithm.max_new_tokens=4"]
    cfg, c = compose(overrides)
    policy = c.policy.build(cfg.seed).eval()
    engine = training_engine(policy, engine_factory(overrides, precision="fp32"))
    assert engine.precision == "fp32"
    bf16 = policy_like(compose([*overrides, "policy.dtype=bfloat16"])[1].policy, policy)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    for (name, a), (_, b) in zip(policy.model.state_dict().items(), bf16.model.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), name
    from ais_lightning.rollout import SamplingConfig
    from ais_lightning.tasks import PromptDataModule

    samples = PromptDataModule(c.task, val_size=3, seed=0).val_samples()
    sampling = SamplingConfig(n=2, max_new_tokens=4, stop_token_ids=[policy.tokenizer.eos_token_id], seed=0)
    batch, pi = score_samples(policy, engine, samples, sampling)
    assert mismatch(pi, batch.rollout_logprobs, batch.response_mask, batch.prompt_index)["kl_k3"] < 1e-9
    assert 0.0 <= sampled_reward(c.task, samples, batch, policy.tokenizer) <= 1.0
    assert 0.0 <= greedy_accuracy(policy, engine, c.task, samples, 4) <= 1.0


def test_the_fp32_engine_of_a_run():
    """The run's trainer-precision copy; for an engine without one the torch engine at fp32, the first engine's
    rollout keys left out (they may not exist on the torch engine)."""
    from types import SimpleNamespace

    from ais_lightning.toolkit.probes import fp32_engine

    overrides = ["rollout=int8", "rollout.compact_below=0.3"]
    _, c = compose(overrides)
    assert fp32_engine(c, overrides) is c.eval_engine
    assert c.eval_engine.keywords["precision"] == "fp32" and c.eval_engine.keywords["compact_below"] == 0.3
    torch_fp32 = fp32_engine(SimpleNamespace(eval_engine=None), overrides)
    assert torch_fp32.keywords["precision"] == "fp32" and torch_fp32.keywords["compact_below"] == 0.5
