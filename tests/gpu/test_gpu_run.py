"""``ais-train`` on one GPU (CUDA-gated): FSDP2 over NCCL (trainer=fsdp_gpu) through the validation before
training, one rollout step and its weight sync, with each GPU rollout engine this machine can run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()


def _rollouts() -> list[str]:
    rollouts = ["bf16"]  # the torch engine on the trainer's GPU
    if not CUDA:
        return rollouts
    cap = torch.cuda.get_device_capability()
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cap[0] == 9 and cuda >= (12, 9):
        rollouts.append("fp8_gemm")
    if cap >= (8, 9) and importlib.util.find_spec("transformer_engine") is not None:
        rollouts.append("te_fp8")
    if cap >= (8, 9) and importlib.util.find_spec("vllm") is not None:
        rollouts.append("vllm_fp8")
    return rollouts


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rollout", _rollouts())
def test_one_gpu_fsdp2_run_through_validation_and_a_weight_sync(tmp_path: Path, rollout: str):
    exe = Path(sys.executable).with_name("ais-train")
    proc = subprocess.run(
        [
            str(exe),
            "trainer=fsdp_gpu",
            "trainer.devices=1",
            "trainer.max_steps=2",
            "trainer.enable_progress_bar=false",
            f"rollout={rollout}",
            "warmstart=disabled",
            "logger=none",
            "algorithm.prompts_per_step=4",
            "algorithm.group_size=4",
            "algorithm.val_size=8",
            "algorithm.val_every_n_steps=1",
            f"output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert any(k.startswith("val/") for k in summary["validation_start"])  # validation before training ran
    assert any(k.startswith("val/") for k in summary["validation"])  # and after the weight syncs
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history) == 2
    # the second step's rollouts came from the synced engine: its mismatch with the trainer is measured
    assert all(h["kl_k3"] == h["kl_k3"] and h["kl_k3"] >= 0 for h in history)  # finite, not NaN
