"""Training-speed tool: one real tiny interleaved run; every printed number comes from its own timers.

Speed itself is never asserted (noisy machines); only that the medians, shares and paired ratios in the
JSON and the table are computed from the per-step timers the same run recorded.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.tools.load_tool import load_tool

PHASES = ("rollout", "logprob", "update", "sync")


def _segment(tok_s: list[float], step_s: list[float]) -> dict:
    steps = [
        {
            "time/rollout_s": 0.4 * s,
            "time/logprob_s": 0.2 * s,
            "time/update_s": 0.3 * s,
            "time/sync_s": 0.05 * s,
            "throughput/rollout_tokens_per_s": t,
            "step_s": s,
            "other_s": 0.05 * s,
            "cpu_s": 1.5 * s,
        }
        for t, s in zip(tok_s, step_s)
    ]
    return {"steps": steps, "load_avg_1min": [1.0, 1.0]}


def test_real_run_reports_ratios_from_its_own_timers(tmp_path):
    tool = load_tool("train_speed")
    out = tmp_path / "speed.json"
    args = ["--config", "tiny", "--steps", "2", "--repeats", "2", "--warmup", "1", "--threads", "1"]
    result = tool.main([*args, "--json", str(out)])

    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    assert [r["rollout"] for r in saved["rows"]] == ["int8", "fp32"]
    segments = saved["segments"]
    assert [len(segments[p]) for p in ("int8", "fp32")] == [2, 2]  # one segment per round and configuration
    for segs in segments.values():
        for seg in segs:
            assert len(seg["steps"]) == 2
            for step in seg["steps"]:
                assert step["throughput/rollout_tokens_per_s"] > 0 and step["time/rollout_s"] > 0
                assert step["other_s"] == pytest.approx(
                    step["step_s"] - sum(step[f"time/{p}_s"] for p in PHASES)
                )

    # Recompute every reported number from the per-step timers (the first step of each segment dropped).
    kept = {p: [seg["steps"][1:] for seg in segs] for p, segs in segments.items()}
    round_tok = {
        p: [statistics.median(s["throughput/rollout_tokens_per_s"] for s in seg) for seg in segs]
        for p, segs in kept.items()
    }
    round_step = {
        p: [statistics.median(s["step_s"] for s in seg) for seg in segs] for p, segs in kept.items()
    }
    rows = {r["rollout"]: r for r in saved["rows"]}
    for p, row in rows.items():
        flat = [s for seg in kept[p] for s in seg]
        assert row["steps_kept"] == 2
        total = sum(s["step_s"] for s in flat)
        for phase in PHASES:
            assert row[f"{phase}_s"] == pytest.approx(statistics.median(s[f"time/{phase}_s"] for s in flat))
            assert row[f"{phase}_share"] == pytest.approx(sum(s[f"time/{phase}_s"] for s in flat) / total)
        assert sum(row[f"{ph}_share"] for ph in (*PHASES, "other")) == pytest.approx(1.0)
        assert row["cores_used"] == pytest.approx(sum(s["cpu_s"] for s in flat) / total)
        assert row["rollout_tokens_per_s"] == pytest.approx(
            statistics.median(s["throughput/rollout_tokens_per_s"] for s in flat)
        )
        per_round = [a / b for a, b in zip(round_tok[p], round_tok["fp32"])]
        assert row["rollout_speedup_per_round"] == pytest.approx(per_round)
        assert row["rollout_speedup"] == pytest.approx(statistics.median(per_round))
        step_ratio = [b / a for a, b in zip(round_step[p], round_step["fp32"])]
        assert row["step_speedup"] == pytest.approx(statistics.median(step_ratio))

    table = tool.markdown_table(saved)
    assert table.count("\n| ") == 2 + 2  # header, separator, one line per configuration
    int8 = rows["int8"]
    lo, hi = min(int8["rollout_speedup_per_round"]), max(int8["rollout_speedup_per_round"])
    cell = f"{int8['rollout_speedup']:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if lo != hi else "")
    assert f"| {int8['cores_used']:.2f} | {int8['rollout_tokens_per_s']:.0f} | {cell} |" in table
    assert f"| {rows['fp32']['rollout_tokens_per_s']:.0f} | 1.00x | 1.00x |" in table
    assert f"{int8['rollout_s']:.2f} ({100 * int8['rollout_share']:.0f}%)" in table


def test_paired_ratio_is_the_median_of_per_round_ratios():
    tool = load_tool("train_speed")
    # int8's best tokens/s (400) and fp32's (300) come from different rounds: best/best (1.33) would mix
    # two machine states; per-round ratios are 2.0, 2.0, 1.0.
    segments = {
        "int8": [_segment([200.0], [10.0]), _segment([400.0], [6.0]), _segment([100.0], [12.0])],
        "fp32": [_segment([100.0], [20.0]), _segment([200.0], [12.0]), _segment([100.0], [12.0])],
    }
    rows = {r["rollout"]: r for r in tool.summarize(segments, warmup=0)}
    assert rows["int8"]["rollout_speedup_per_round"] == pytest.approx([2.0, 2.0, 1.0])
    assert rows["int8"]["rollout_speedup"] == pytest.approx(2.0)
    assert rows["int8"]["step_speedup_per_round"] == pytest.approx([2.0, 2.0, 1.0])
    assert rows["fp32"]["rollout_speedup"] == 1.0
    assert rows["int8"]["rollout_share"] == pytest.approx(0.4)
    assert rows["int8"]["other_share"] == pytest.approx(0.05)
    assert rows["int8"]["cores_used"] == pytest.approx(1.5)
    # a segment's value is the median of its steps: the warm-up step is left out
    two = {
        "int8": [_segment([1.0, 300.0, 500.0], [1, 1, 1])],
        "fp32": [_segment([1.0, 200.0, 200.0], [1, 1, 1])],
    }
    assert tool.summarize(two, warmup=1)[0]["rollout_speedup"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="--warmup 3 leaves no step"):
        tool.summarize(two, warmup=3)
    with pytest.raises(ValueError, match="one value per round"):
        tool.paired_ratios([1.0, 2.0], [1.0])


def test_the_reference_must_be_run():
    tool = load_tool("train_speed")
    with pytest.raises(SystemExit):
        tool.main(["--config", "tiny", "--rollouts", "int8"])
