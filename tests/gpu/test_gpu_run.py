"""``ais-train`` on one GPU (CUDA-gated): FSDP2 over NCCL (trainer=fsdp_gpu) through the validation before
training (under Lightning's ``inference_mode``), rollout steps and their weight syncs, with each GPU rollout
engine this machine can run; at fp32 on both sides the rollout and trainer log-probs agree, and the validation
accuracies are read back from the run's summary."""

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


def _run(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    """``ais-train trainer=fsdp_gpu`` on one GPU for 2 rollout steps, validating after each; its summary and
    history, read back from the files the run wrote."""
    exe = Path(sys.executable).with_name("ais-train")
    proc = subprocess.run(
        [
            str(exe),
            "trainer=fsdp_gpu",
            "trainer.devices=1",
            "trainer.max_steps=2",
            "trainer.enable_progress_bar=false",
            "warmstart=disabled",
            "logger=none",
            "algorithm.prompts_per_step=4",
            "algorithm.group_size=4",
            "algorithm.val_size=8",
            "algorithm.val_every_n_steps=1",
            f"output_dir={tmp_path}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    history = json.loads((tmp_path / "history.json").read_text())
    assert summary["status"] == "finished" and len(history) == 2
    # the validation accuracies, before training (under Lightning's inference_mode: the engine sync out of
    # FSDP2 ran there) and after the weight syncs, read back as numbers
    assert summary["validations"] >= 2
    for accuracies in (summary["validation_start"], summary["validation"]):
        assert 0.0 <= accuracies["val/accuracy_engine"] <= 1.0, accuracies
    return summary, history


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rollout", _rollouts())
def test_one_gpu_fsdp2_run_through_validation_and_a_weight_sync(tmp_path: Path, rollout: str):
    _, history = _run(tmp_path, f"rollout={rollout}")
    # the second step's rollouts came from the synced engine: its mismatch with the trainer is measured
    assert all(h["kl_k3"] == h["kl_k3"] and h["kl_k3"] >= 0 for h in history)  # finite, not NaN


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_one_gpu_fsdp2_run_at_fp32_rollout_and_trainer_logprobs_agree(tmp_path: Path):
    """fp32 rollouts against an fp32 trainer (``trainer.precision=32-true``): after every weight sync the
    engine's log-probs are the trainer's up to kernel rounding (k3 mismatch < 1e-6; bf16 anywhere on either
    side gives ~1e-3), and the one fp32 engine serves both validation accuracies."""
    summary, history = _run(tmp_path, "rollout=fp32", "trainer.precision=32-true")
    for h in history:
        assert 0.0 <= h["kl_k3"] < 1e-6, history
    for accuracies in (summary["validation_start"], summary["validation"]):
        assert accuracies["val/accuracy_trainer"] == accuracies["val/accuracy_engine"], accuracies
