"""tools/gpu_smoke.sh and tools/gpu_smoke.py: the dry run (every check on the CPU stand-ins) as CI runs it, and a
failing check making the run exit nonzero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ais_lightning.toolkit.gpu_smoke import CHECKS
from tests.tools.load_tool import TOOLS, load_tool

tool = load_tool("gpu_smoke")


@pytest.mark.slow
def test_the_dry_run_passes_every_check_end_to_end(tmp_path):
    """``bash tools/gpu_smoke.sh --dry --with-te`` as written: no install, every check (Transformer Engine's too)
    on the CPU stand-ins, PASS per check, exit status 0 and the JSON summary with each check's numbers."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        ["bash", str(TOOLS / "gpu_smoke.sh"), "--dry", "--with-te", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert summary["passed"] and summary["mode"].startswith("dry") and list(checks) == list(CHECKS)
    for name, check in checks.items():
        assert check["status"] == "PASS", check
        assert f"PASS  {name}" in proc.stdout
    parity = checks["vllm_parity"]["numbers"]
    assert all(parity[label]["max_abs_delta"] < 1e-3 for label in ("T=1", "T=0.7", "top_p=0.9", "greedy"))
    assert parity["after_sync"]["max_abs_delta_vs_old"] > 0.1  # the sync changed what the engine computes
    assert checks["te_fp8"]["numbers"]["split_accumulator"] == {"current": True, "block": True, "mxfp8": True}
    assert checks["gpu_tests"]["numbers"]["collected"] > 0
    assert set(checks["fp8_gemm_shapes"]["numbers"]["recipes"]) == {"fp8_tensor", "fp8_channel", "fp8"}


def test_a_failing_check_makes_the_run_exit_1(monkeypatch, tmp_path, capsys):
    """The blockwise weight scales in the unpadded layout the legacy ``torch._scaled_mm`` took (PyTorch PR 166752):
    the cuBLASLt stand-in refuses them as torch does, the check FAILs, the run exits 1 and says so."""
    import ais_lightning.quant.linear as linear

    monkeypatch.setattr(
        linear, "blockwise_weight_operands", lambda data, scale: (data.contiguous().t(), scale.t())
    )
    out = tmp_path / "smoke.json"
    assert tool.main(["--dry", "--only", "fp8_gemm_shapes", "--json", str(out)]) == 1
    (check,) = json.loads(out.read_text())["checks"]
    assert check["status"] == "FAIL" and "scale_b must have shape" in check["detail"]
    assert "FAIL  fp8_gemm_shapes" in capsys.readouterr().out


def test_the_gpu_run_without_a_gpu_fails_its_environment_check(tmp_path):
    """Without ``--dry`` the checks run on ``cuda:0``: on a machine without CUDA the environment check fails and
    the shell script's exit status is the tool's (skipping the install: ``--only`` and a bad check name)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert tool.main(["--only", "environment", "--json", str(tmp_path / "s.json")]) == 1
    check = json.loads((tmp_path / "s.json").read_text())["checks"][0]
    assert check["status"] == "FAIL" and "no CUDA device" in check["detail"]
    proc = subprocess.run(
        ["bash", str(TOOLS / "gpu_smoke.sh"), "--dry", "--only", "no_such_check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
