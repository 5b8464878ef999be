"""tools/truncation_replay.py: the three scorings of truncated samples, checked against each other on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from tests.tools.load_tool import load_tool

tool = load_tool("truncation_replay")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_parse_truncation():
    assert tool.parse_truncation("top_p=0.9,top_k=20") == {"top_p": 0.9, "top_k": 20}
    assert tool.parse_truncation("min_p=0.1") == {"min_p": 0.1}
    with pytest.raises(ValueError, match="top_p=P"):
        tool.parse_truncation("top_q=0.9")


@pytest.mark.parametrize(("precision", "same"), [("fp32", True), ("fp4", False)])
def test_the_trainers_own_filter_is_replay_at_fp32_and_not_below(precision, same):
    """At fp32 the trainer's logits are the engine's, so NeMo-RL's trainer-side set is the engine's and its
    log-probs are the replayed ones; at fp4 the sets differ at some positions (and none of the scorings is -inf
    where the sampled token is inside)."""
    policy = Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()).eval()
    engine = TorchRolloutEngine(policy.model, precision=precision)
    sampling = SamplingConfig(n=4, max_new_tokens=8, seed=0, top_p=0.8, temperature=0.7)
    batch = engine.generate(policy.encode_prompts(["1+2=", "33+4=", "5+5="]), sampling)
    trainer, inside = tool.trainer_side_logprobs(policy, batch, 0.7, {"top_p": 0.8}, rows=5)
    with torch.no_grad():
        replay = policy.batch_logprobs(batch, 0.7).logprobs
    mask = batch.response_mask
    assert bool(inside[mask].all()) or not same
    close = torch.isclose(trainer[mask & inside], replay[mask & inside], atol=2e-5, rtol=0)
    assert bool(close.all()) == same
    result = tool.score_three_ways(policy, batch, 0.7, {"top_p": 0.8})
    assert result["none"]["kl_k3"] > 1e-3 and result["none"]["kl_k3"] > result["replay"]["kl_k3"]
    assert (result["replay"]["kl_k3"] < 1e-9) == same  # at fp32 replay leaves no mismatch at all
    assert result["kept_mean"] > 1 and result["support_bytes_per_position"] > 4


@pytest.mark.slow
def test_a_tiny_run_prints_the_table(tmp_path, capsys):
    out = tmp_path / "replay.json"
    args = [
        "--seeds",
        "0",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--precisions",
        "int8",
        "--truncations",
        "top_k=5",
    ]
    assert tool.main([*args, "--json", str(out), "warmstart.enabled=false"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kept_mean"] == 5.0 and row["replay"]["kl_k3"] < row["none"]["kl_k3"]
    assert "| `int8` | `top_k=5` | engine's set (replay) |" in capsys.readouterr().out


@pytest.mark.slow
def test_a_tiny_grpo_run_compares_the_corrector_with_and_without_replay(tmp_path, capsys):
    """Two rollout steps of the smoke run at top-p 0.9: the untrained model keeps ~85 of 99 tokens, so without
    replay AIS sees the kept mass as a mismatch (k3 ~5e-3) that replay does not (int8's own, ~1e-5)."""
    out = tmp_path / "grpo.json"
    args = [
        "--grpo",
        "--batches",
        "2",
        "--json",
        str(out),
        "experiment=smoke",
        "algorithm.top_p=0.9",
        "corrector=ais",
    ]
    assert tool.main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 2
    mean = result["mean"]
    assert mean["kl_k3_none"] > 10 * mean["kl_k3_replay"] and mean["lambda_none"] > mean["lambda_replay"]
    assert mean["weight_abs_diff"] > 0
    assert "| AIS lambda |" in capsys.readouterr().out
