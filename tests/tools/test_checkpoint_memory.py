"""tools/checkpoint_memory.py on the tiny preset: both settings measured, checkpointing saves less."""

import json

from tests.tools.load_tool import load_tool


def test_checkpointing_saves_fewer_activation_bytes_and_reports_a_paired_time_ratio(tmp_path):
    tool = load_tool("checkpoint_memory")
    out = tmp_path / "ckpt.json"
    result = tool.main(["--config", "tiny", "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    plain, checkpointed = result["rows"]
    assert (plain["gradient_checkpointing"], checkpointed["gradient_checkpointing"]) == (False, True)
    assert 0 < checkpointed["saved_mb"] < 0.5 * plain["saved_mb"]
    assert len(result["runs"]["true"]) == len(result["runs"]["false"]) == 2
    ratios = [c["seconds"] / p["seconds"] for p, c in zip(result["runs"]["false"], result["runs"]["true"])]
    assert min(ratios) == result["time_ratio"]["min"] and max(ratios) == result["time_ratio"]["max"]
    assert result["batch"] == {
        "rows": 16,
        "prompt_tokens": 16,
        "response_tokens": 4,
    }  # the smoke preset's shape
