"""tools/model_mismatch.py --check: the peers' thresholds, the verdict table, and a tiny run on the built-in model."""

from __future__ import annotations

import json

import pytest

from tests.tools.load_tool import load_tool

tool = load_tool("model_mismatch")


def row(label, mult, kl, dlogp=0.0):
    return {"precision": label, "token_mult_prob_error": mult, "kl_k3": kl, "max_abs_dlogp": dlogp}


def test_the_peers_thresholds():
    # NeMo-RL accepts token_mult_prob_error <= 1.05 (1.05 itself passes); prime-rl mismatch KL < 0.015 (strict)
    assert tool.passes("token_mult_prob_error", 1.05) and not tool.passes("token_mult_prob_error", 1.0501)
    assert tool.passes("kl_k3", 0.0149) and not tool.passes("kl_k3", 0.015)


def test_alignment_table_verdicts_and_our_gate():
    rows = [row("fp32", 1.06, 0.001, 0.2), row("fp8", 1.02, 0.02)]
    table = tool.alignment_table(rows, gate=1.05).splitlines()
    assert table[2].startswith("| `fp32` | 1.06000 | FAIL | <= 1.05 FAIL | 1.00e-03 | pass |")
    assert table[3].startswith("| `fp8` | 1.02000 | pass | (fp32 only) | 2.00e-02 | FAIL |")
    assert "| off |" in tool.alignment_table(rows, gate=None).splitlines()[2]


def test_check_exits_1_when_the_fp32_engine_misses_a_threshold(monkeypatch, tmp_path):
    monkeypatch.setattr(
        tool, "check", lambda policy, c, args: [row("fp32", 1.0, 0.02), row("int8", 1.0, 0.0)]
    )
    monkeypatch.setattr(tool, "markdown", lambda rows: "")
    out = tmp_path / "check.json"
    assert tool.main(["--check", "--json", str(out), "--", "warmstart.enabled=false"]) == 1
    assert json.loads(out.read_text())["rows"][0]["kl_k3"] == 0.02


@pytest.mark.slow
def test_a_tiny_check_of_the_built_in_model(tmp_path, capsys):
    """The default run (tiny Qwen3, int8 rollouts): its fp32 engine agrees with the policy to rounding."""
    out = tmp_path / "check.json"
    args = ["--check", "--seeds", "0", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4"]
    args += ["--eval-prompts", "2", "--json", str(out), "--", "warmstart.enabled=false"]
    assert tool.main(args) == 0
    fp32, rollout = json.loads(out.read_text())["rows"]
    assert (fp32["precision"], rollout["precision"]) == ("fp32", "int8")
    assert fp32["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5) and fp32["kl_k3"] < 1e-9
    assert rollout["token_mult_prob_error"] > 1.0
    assert "fp32 alignment: pass" in capsys.readouterr().out


def test_matched_rows_parse_and_refuse_unknown_ones():
    assert tool.parse_matched("fp16") == ("fp16", False, False)
    assert tool.parse_matched("bf16:fp32") == ("bf16", True, True)
    assert tool.parse_matched("bf16:fp32-engine") == ("bf16", False, True)
    assert tool.parse_matched("fp16:fp32-policy") == ("fp16", True, False)
    for bad in ("int8", "bf16:fp16", "fp32:both"):
        with pytest.raises(ValueError, match="PRECISION\\[:HEAD\\]"):
            tool.parse_matched(bad)


@pytest.mark.slow
def test_a_tiny_matched_run_casts_both_sides(tmp_path, capsys):
    """--matched on the built-in model through its own forward: bf16 on both sides is bit for bit (KL 0); an fp32
    head on the engine only is not."""
    out = tmp_path / "matched.json"
    args = ["--matched", "bf16,bf16:fp32-engine", "--model-impl", "transformers", "--json", str(out)]
    args += ["--seeds", "0", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4"]
    args += ["--eval-prompts", "2"]
    assert tool.main([*args, "--", "warmstart.enabled=false"]) == 0
    same, one_sided = json.loads(out.read_text())["rows"]
    assert (same["policy_head_fp32"], same["engine_head_fp32"]) == (False, False) and same["kl_k3"] == 0.0
    assert (one_sided["policy_head_fp32"], one_sided["engine_head_fp32"]) == (False, True)
    assert one_sided["max_abs_dlogp"] > 0
    assert "| `bf16` | fp32, engine only |" in capsys.readouterr().out
