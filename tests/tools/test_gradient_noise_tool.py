"""tools/gradient_noise.py on the tiny model: the real pipeline, per-group gradients that add up to the batch's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ais_lightning.tasks.arithmetic import Arithmetic
from tests.tools.load_tool import load_tool


@dataclass
class ParityArithmetic(Arithmetic):
    """Rewards 1 for an odd-length completion: an untrained model gets varied rewards, so nonzero advantages."""

    def reward(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        return [float(len(c) % 2) for c in completions]


def _overrides(tmp_path: Path) -> list[str]:
    conf = tmp_path / "conf" / "task"
    conf.mkdir(parents=True)
    (conf / "parity.yaml").write_text(f"_target_: {__name__}.ParityArithmetic\n")
    return [
        "experiment=smoke",
        "trainer.num_threads=1",
        "task=parity",
        "algorithm.max_new_tokens=6",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
    ]


def test_measures_every_group_and_the_groups_add_up_to_the_batch_gradient(tmp_path, capsys):
    tool = load_tool("gradient_noise")
    result = tool.measure(_overrides(tmp_path), batches=3, seed=0)
    assert result["groups"] == 3 * 4 and result["groups_per_batch"] == 4  # smoke: 4 prompts x 4 samples
    assert result["trace_sigma"] > 0, "varied rewards give nonzero group gradients"
    assert result["unit_mean_rel_error"] < 1e-5, "the scaled group gradients average to the batch gradient"
    phi = result["noise_to_signal"]
    assert phi == pytest.approx(result["noise_scale_groups"] / 4) or math.isinf(phi)
    text = tool.format_result(result)
    assert "| groups measured (3 batches x 4 prompts x 4 samples) | 12 |" in text


def test_advice_names_a_batch_without_any_advantage():
    tool = load_tool("gradient_noise")
    zero = {"trace_sigma": 0.0, "signal_sq": 0.0, "noise_to_signal": math.inf}
    assert "every group's gradient is zero" in tool._advice(zero)
    lost = {"trace_sigma": 2.0, "signal_sq": -0.1, "noise_to_signal": math.inf}
    assert "lost in the noise" in tool._advice(lost)
    assert "corrector.noise_to_signal=0.25" in tool._advice(
        {"trace_sigma": 1.0, "signal_sq": 1.0, "noise_to_signal": 0.25}
    )


def test_batches_must_be_positive():
    with pytest.raises(SystemExit):
        load_tool("gradient_noise").main(["--batches", "0"])
