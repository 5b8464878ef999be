"""Rollout benchmark tool: one real (tiny, 2-token) run writes consistent JSON and a markdown table.

Speed itself is never asserted here (noisy machines); only that the reported ratios are derived
from the reported times of the same run (paired per repeat) and that every requested engine has a row.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from tests.tools.load_tool import load_tool


def _load_tool():
    return load_tool("bench_rollout")


def test_bench_rows_ratios_and_table(tmp_path):
    bench = _load_tool()
    out = tmp_path / "bench.json"
    engines = ["hf-fp32", "torch-fp32", "torch-int8", "torch_hf-int8"]
    result = bench.main(["--config", "tiny", "--engines", *engines, "--new-tokens", "2", "--out", str(out)])

    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    rows = {r["engine"]: r for r in saved["rows"]}
    assert list(rows) == engines
    base, hf = rows["torch-fp32"]["tokens_per_s"], rows["hf-fp32"]["tokens_per_s"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0
        assert r["vs_torch_fp32"] == pytest.approx(r["tokens_per_s"] / base)
        assert r["vs_hf_fp32"] == pytest.approx(r["tokens_per_s"] / hf)
        # ms per step and tokens/s describe the same timing: batch * 1000 / ms_per_step
        assert r["batch"] == saved["shape"]["batches"][0]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1000 / r["ms_per_step"])
    assert rows["torch-int8"]["roofline_rate"] == rows["torch_hf-int8"]["roofline_rate"] == "int8"
    assert rows["torch-fp32"]["roofline_rate"] == "fp32"

    table = bench.markdown_table(saved)
    assert table.count("\n| ") == 2 + len(engines)  # header, separator, one line per engine
    assert "| torch-int8 |" in table


def test_paired_speedup_is_the_median_of_per_repeat_ratios():
    bench = _load_tool()
    # the two engines' best times (10 and 4.8) come from different repeats, so best/best (2.08) mixes
    # two machine states; per-repeat ratios are 2.0, 2.0, 2.5.
    assert bench.paired_speedup([10.0, 30.0, 12.0], [5.0, 15.0, 4.8]) == pytest.approx(2.0)
    assert bench.paired_speedup([10.0, 30.0], [5.0, 10.0]) == pytest.approx(
        2.5
    )  # even count: mean of middle two
    with pytest.raises(ValueError, match="one time per repeat"):
        bench.paired_speedup([1.0, 2.0], [1.0])


def test_repeats_pair_ratios_within_each_round(tmp_path):
    bench = _load_tool()
    engines = ["torch-fp32", "torch-int8"]
    result = bench.main(
        [
            "--config",
            "tiny",
            "--engines",
            *engines,
            "--new-tokens",
            "2",
            "--repeats",
            "2",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    ref, int8 = result["rows"]
    assert "| n/a |" in bench.markdown_table(result)  # no hf-fp32 row: its ratio column says so
    assert len(ref["seconds"]) == len(int8["seconds"]) == 2
    per_round = [a / b for a, b in zip(ref["seconds"], int8["seconds"])]
    assert int8["vs_torch_fp32"] == pytest.approx(sum(per_round) / 2)
    assert int8["vs_torch_fp32_per_repeat"] == pytest.approx(per_round)
    lo, hi = sorted(per_round)
    table = bench.markdown_table(result)
    assert f"| {sum(per_round) / 2:.2f}x ({lo:.2f}-{hi:.2f}) |" in table
    assert "| 1.00x |" in table  # the reference against itself: no range
    assert int8["tokens_per_s"] == pytest.approx(int8["batch"] * 2 / min(int8["seconds"]))


def test_vllm_rows_skip_cleanly_without_a_vllm_interpreter(tmp_path):
    bench = _load_tool()
    result = bench.main(
        [
            "--config",
            "tiny",
            "--engines",
            "torch-fp32",
            "vllm-fp32",
            "--new-tokens",
            "2",
            "--vllm-python",
            "none",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    vllm_row = result["rows"][1]
    assert vllm_row["engine"] == "vllm-fp32" and "vllm" in vllm_row["skipped"].lower()
    assert "skipped" in bench.markdown_table(result)


def test_precisions_set_the_torch_engines_and_are_checked():
    bench = _load_tool()
    engines = ["hf-fp32", "torch-fp32", "torch-bf16", "vllm-bf16"]
    assert bench.engine_list(engines, ["int8", "fp32"]) == [
        "hf-fp32",
        "torch-int8",
        "torch-fp32",
        "vllm-bf16",
    ]
    assert bench.engine_list(engines, None) == engines
    with pytest.raises(SystemExit):
        bench.main(["--precisions", "fp32,fp33"])
    with pytest.raises(SystemExit):
        bench.main(["--engines", "trt-fp32"])


def test_phase_timers_time_the_wrapped_functions_and_restore_them():
    bench = _load_tool()
    module = types.ModuleType("fake_engine")
    module.validate_sync = lambda x: x + 1
    original = module.validate_sync
    with bench.phase_timers(module, {"validate": "validate_sync", "copy": "absent"}) as spent:
        assert module.validate_sync(1) == 2
        assert module.validate_sync is not original
    assert module.validate_sync is original
    assert set(spent) == {"validate"} and spent["validate"] >= 0


def test_batches_samples_sync_and_profile_in_one_run(tmp_path):
    """The SmolLM2 command's path (--precisions, two batches of prompts x samples, --sync, --profile) on the
    tiny model: rows per (engine, batch) paired within their batch, a sync breakdown per torch engine, a
    per-function decode profile, and the machine described."""
    bench = _load_tool()
    result = bench.main(
        [
            "--config",
            "tiny",
            "--engines",
            "hf-fp32",
            "torch-fp32",
            "--precisions",
            "fp32,int8",
            "--batches",
            "8",
            "16",
            "--samples",
            "4",
            "--new-tokens",
            "3",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--sync",
            "--profile",
            "int8",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    rows = {(r["engine"], r["batch"]): r for r in result["rows"]}
    assert list(rows) == [(e, b) for b in (8, 16) for e in ("hf-fp32", "torch-fp32", "torch-int8")]
    for (_, batch), r in rows.items():
        ref = rows["torch-fp32", batch]["seconds"]
        assert r["vs_torch_fp32_per_repeat"] == pytest.approx([a / b for a, b in zip(ref, r["seconds"])])
        assert r["build_s"] >= 0 and r["run_peak_mb"] >= 0 and len(r["seconds"]) == 2
    assert rows["torch-int8", 8]["build_s"] == rows["torch-int8", 16]["build_s"]  # built once

    sync = {s["engine"]: s for s in result["sync"]}
    assert set(sync) == {"torch-fp32", "torch-int8"}
    for s in sync.values():
        assert set(s["phases_s"]) == {"validate", "copy", "requantize", "other"}
        for run in s["runs"]:
            assert run["total"] == pytest.approx(sum(v for k, v in run.items() if k != "total"))
    assert sync["torch-int8"]["phases_s"]["requantize"] > 0

    (prof,) = result["profile"]
    assert prof["precision"] == "int8" and prof["batch"] == 16
    chains = prof["decode_functions"]
    assert chains and prof["decode_functions_ms_per_step"] == pytest.approx(sum(ms for _, ms, _ in chains))

    assert result["cpu"]["cores"] >= 1 and isinstance(result["cpu"]["flags"], list)
    assert len(result["load_average"]) >= 2 + 2  # start, warm-up, each round (+ sync, profile)
    table = bench.markdown_table(result)
    assert "weight sync" in table and "decode step by function" in table and "load average" in table


@pytest.mark.slow  # a second Python process (~5-10 s)
def test_an_engine_runs_in_a_worker_process(tmp_path):
    """The worker protocol vLLM uses, with a torch engine in this interpreter (no vLLM needed)."""
    bench = _load_tool()
    from ais_lightning.models import build_tiny_qwen3

    build_tiny_qwen3(seed=0).save_pretrained(tmp_path)
    engine = bench.RemoteEngine("torch-int8", sys.executable, str(tmp_path), 1)
    try:
        assert engine.build_seconds > 0 and engine.weight_bytes > 0 and engine.threads == 1
        assert engine.warmup([[5, 6, 7]], 2, 3) >= 0
        assert engine.timed([[5, 6, 7]], 2, 3) > 0
        assert engine.process_peak_bytes > 0
    finally:
        engine.close()
    assert engine.proc.returncode == 0
    with pytest.raises(RuntimeError):
        bench.RemoteEngine("torch-fp32", sys.executable, str(tmp_path / "missing"), 1)
