"""tools/solrl_compare.py on hand-made run records: training seconds, phase shares, the time budget."""

from __future__ import annotations

import math

import pytest

from ais_lightning.toolkit.report import ReportError, RunRecord
from tests.tools.load_tool import load_tool

tool = load_tool("solrl_compare")


def _run(algorithm: str, precision: str, seed: int, times: dict[str, float], acc: list[float]) -> RunRecord:
    """Three training steps with the same phase times each; validation before training and after step 2."""
    histories = {key: [(s, value) for s in (1, 2, 3)] for key, value in times.items()}
    histories["val/accuracy_trainer"] = [(0, acc[0]), (2, acc[1]), (3, acc[2])]
    histories["reward/mean"] = [(1, 0.1), (2, 0.2), (3, 0.3)]
    if algorithm == "solrl":
        histories["solrl/token_agreement"] = [(1, 0.9), (2, 0.95), (3, 1.0)]
    params = {"algorithm": algorithm, "rollout.precision": precision, "corrector": "none", "seed": str(seed)}
    return RunRecord(
        run_id=f"{algorithm}{precision}{seed}",
        run_name="",
        status="FINISHED",
        params=params,
        metrics={},
        histories=histories,
    )


GRPO = {"time/rollout_s": 2.0, "time/logprob_s": 0.5, "time/update_s": 1.0, "time/sync_s": 0.5}  # 4 s/step
SOLRL = {
    "time/screen_s": 3.0,
    "time/regen_s": 1.0,
    "time/rollout_s": 4.0,  # screen + regen: must not be counted twice
    "time/select_s": 0.5,
    "time/regen_sync_s": 0.5,
    "time/logprob_s": 0.5,
    "time/update_s": 1.0,
    "time/sync_s": 0.5,
}  # 7 s/step


def test_training_seconds_count_every_phase_once():
    assert tool.cumulative_seconds(_run("grpo", "int8", 0, GRPO, [0, 0, 0])) == {1: 4.0, 2: 8.0, 3: 12.0}
    assert tool.cumulative_seconds(_run("solrl", "int8", 0, SOLRL, [0, 0, 0])) == {1: 7.0, 2: 14.0, 3: 21.0}


def test_phase_shares_put_generation_in_the_right_engine():
    solrl = tool.run_summary(_run("solrl", "int8", 0, SOLRL, [0, 0, 0]))
    assert solrl["share/cheap_gen"] == pytest.approx(3 / 7)
    assert solrl["share/exact_gen"] == pytest.approx(1.5 / 7)
    assert sum(v for k, v in solrl.items() if k.startswith("share/")) == pytest.approx(1.0)
    int8 = tool.run_summary(_run("grpo", "int8", 0, GRPO, [0, 0, 0]))
    fp32 = tool.run_summary(_run("grpo", "fp32", 0, GRPO, [0, 0, 0]))
    assert int8["share/cheap_gen"] == 0.5 and int8["share/exact_gen"] == 0.0
    assert fp32["share/exact_gen"] == 0.5 and fp32["share/cheap_gen"] == 0.0
    assert solrl["solrl/token_agreement"] == pytest.approx(0.95)
    assert math.isnan(int8["solrl/token_agreement"])


def test_equal_time_takes_the_last_validation_within_the_budget():
    runs = [
        _run("grpo", "int8", 0, GRPO, [0.5, 0.6, 0.7]),
        _run("grpo", "int8", 1, GRPO, [0.5, 0.7, 0.8]),
        _run("solrl", "int8", 0, SOLRL, [0.5, 0.8, 0.9]),
    ]
    rows, budget = tool.compare(runs)
    assert budget == 12.0, "the shortest configuration's training time"
    by = {r["config"]["algorithm"]: r for r in rows}
    assert by["grpo"]["runs"] == 2
    assert by["grpo"]["val/accuracy_trainer@end"] == pytest.approx([0.75, math.sqrt(0.005)])
    assert by["grpo"]["val/accuracy_trainer@budget"][0] == pytest.approx(0.75)
    # Sol-RL spent 14 s by step 2: within 12 s only the validation before training counts
    assert by["solrl"]["val/accuracy_trainer@end"][0] == pytest.approx(0.9)
    assert by["solrl"]["val/accuracy_trainer@budget"][0] == pytest.approx(0.5)
    rows, _ = tool.compare(runs, budget_s=15.0)
    assert {r["config"]["algorithm"]: r for r in rows}["solrl"]["val/accuracy_trainer@budget"][0] == 0.8
    text = tool.markdown(rows, 15.0)
    assert "algorithm=solrl" in text and "15 training seconds" in text
    with pytest.raises(ReportError):
        tool.compare([])
