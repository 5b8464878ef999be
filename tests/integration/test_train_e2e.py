"""End-to-end: ``ais-train`` on the tiny model with real Lightning Trainers and real MLflow stores."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ais_lightning.quant.cpu_int8 import cpu_int8_isa, default_int8_backend
from tests.integration.helpers import SMOKE, run_train
from tests.mlflow_server import mlflow_server

pytestmark = pytest.mark.slow


def test_smoke_run_writes_summary_config_and_checkpoint(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_train([*SMOKE, f"hydra.run.dir={out}", "logger=csv"], cwd=tmp_path)
    assert "ais-train summary" in proc.stdout
    # which engine, int8 kernel (this CPU's: the run probes the same one) and forward ran
    assert f"TorchRolloutEngine int8 (backend {default_int8_backend()}: " in proc.stdout
    assert "; lean forward)" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert math.isfinite(summary["kl_k3_mean"]) and summary["kl_k3_mean"] >= 0
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert "corrector" in (out / "config.yaml").read_text()


def test_multirun_lands_as_four_mlflow_runs_in_one_experiment(tmp_path: Path):
    sweep_dir = tmp_path / "sweep"
    run_train(
        ["-m", *SMOKE, "logger=mlflow", "corrector=none,tis,mis,ais", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
    )
    db = sweep_dir / "mlflow.db"
    assert db.exists(), "the default store of a multirun is one SQLite file under the sweep directory"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("ais_lightning")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.params["corrector"] for r in runs) == ["ais", "mis", "none", "tis"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.params["rollout.precision"] == "int8"
        assert run.data.params["engine/backend"] == default_int8_backend()  # the kernel that ran, on this CPU
        assert run.data.params["engine/cpu_int8"] == cpu_int8_isa()
        history = client.get_metric_history(run.info.run_id, "mismatch/kl_k3")
        assert len(history) == 2, "one value per rollout step"
        assert "summary/reward_last" in run.data.metrics
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "summary.json", "summary.png"} <= artifacts
    ais = next(r for r in runs if r.data.params["corrector"] == "ais")
    assert 0.0 <= ais.data.metrics["ais/lambda"] <= 1.0


def test_metrics_arrive_at_a_real_mlflow_server(tmp_path: Path):
    with mlflow_server(tmp_path) as uri:
        run_train(
            [*SMOKE, "logger=mlflow", f"logger.tracking_uri={uri}", "logger.experiment_name=server_test"],
            cwd=tmp_path,
        )
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("server_test")
        (run,) = client.search_runs([exp.experiment_id])
        assert run.info.status == "FINISHED"
        assert len(client.get_metric_history(run.info.run_id, "reward/mean")) == 2
        assert run.data.params["corrector"] == "ais"
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "summary.json", "summary.png"} <= artifacts


def test_killed_run_resumes_with_the_same_metrics(tmp_path: Path):
    """Kill a run after its step-2 checkpoint; resuming from it reproduces the uninterrupted run.

    The killed run logs to MLflow: it must not look FINISHED (Lightning finalizes the logger after
    the validation that precedes training; ``ais-train`` reopens the run), so a sweep report never
    averages it."""
    common = [*SMOKE, "trainer.checkpoint_every_n_steps=1", "corrector.ema_decay=0.5"]
    four_steps = [*common, "logger=none", "trainer.max_steps=4"]
    full = tmp_path / "full"
    run_train([*four_steps, f"hydra.run.dir={full}"], cwd=tmp_path)
    expected = json.loads((full / "history.json").read_text())
    assert len(expected) == 4

    killed = tmp_path / "killed"
    store = f"sqlite:///{tmp_path / 'killed.db'}"
    env = {"TOKENIZERS_PARALLELISM": "false", "AIS_LIGHTNING_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ais_lightning.app.train",
            *common,
            # far more steps than the poll below can miss: the run is still training when it is killed
            # (with 4 steps a loaded machine let it finish between two polls). Batch k is the same
            # whatever max_steps is, so its step-2 checkpoint is the 4-step run's.
            "trainer.max_steps=1000",
            f"hydra.run.dir={killed}",
            "logger=mlflow",
            f"logger.tracking_uri={store}",
        ],
        cwd=tmp_path,
        env={**__import__("os").environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt_dir = killed / "checkpoints"
    deadline = time.time() + 300
    step2 = None
    while step2 is None and time.time() < deadline and proc.poll() is None:
        found = sorted(ckpt_dir.glob("step000002.ckpt")) if ckpt_dir.exists() else []
        step2 = found[0] if found else None
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    step2 = step2 or next(iter(sorted(ckpt_dir.glob("step000002.ckpt"))), None)
    assert step2 is not None, "the run never wrote its step-2 checkpoint"
    time.sleep(
        0.5
    )  # let a checkpoint being written when killed settle (it is written atomically by Lightning)

    (run,) = MlflowClient(tracking_uri=store).search_runs(
        [MlflowClient(tracking_uri=store).get_experiment_by_name("ais_lightning").experiment_id]
    )
    assert run.info.status == "RUNNING", "a killed run must not look FINISHED"
    assert len(run.data.params) > 10 and "val/accuracy_engine" in run.data.metrics
    assert "tracking_uri" not in run.info.run_name, run.info.run_name

    resumed = tmp_path / "resumed"
    run_train([*four_steps, f"hydra.run.dir={resumed}", f"ckpt_path={step2}"], cwd=tmp_path)
    got = json.loads((resumed / "history.json").read_text())
    assert [h["step"] for h in got] == [h["step"] for h in expected]
    for a, b in zip(got, expected):
        for key in ("reward", "kl_k3", "entropy", "lambda"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)


def test_qarl_trains_a_few_steps_on_fp8_rollouts(tmp_path: Path):
    out = tmp_path / "qarl"
    run_train([*SMOKE, "corrector=qarl", "rollout=fp8", "logger=csv", f"hydra.run.dir={out}"], cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    # The trainer's forward is aligned with the fp8 engine: the mismatch is (nearly) gone.
    assert summary["kl_k3_mean"] < 1e-5


def test_gradient_checkpointing_trains_the_same_run(tmp_path: Path):
    """``policy.gradient_checkpointing=true`` recomputes the layers in backward: the same 3 steps, to rounding."""
    histories = []
    for flag in ("false", "true"):
        out = tmp_path / flag
        run_train(
            [*SMOKE, "trainer.max_steps=3", f"policy.gradient_checkpointing={flag}", "logger=none",
             f"hydra.run.dir={out}"],
            cwd=tmp_path,
        )  # fmt: skip
        histories.append(json.loads((out / "history.json").read_text()))
    plain, checkpointed = histories
    assert len(plain) == len(checkpointed) == 3
    for a, b in zip(plain, checkpointed):
        for key in ("reward", "kl_k3", "entropy", "lambda"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)


@pytest.mark.parametrize(
    "extra",
    [[], ["rollout=fp32", "algorithm.top_k=20", "corrector.c=4"]],
    ids=["issue-44-command", "fp32-exact"],
)
def test_top_p_with_a_corrector_trains_on_replayed_ratios(tmp_path: Path, extra):
    """Issue 44's acceptance command, ``algorithm.top_p=0.9 corrector=ais`` (int8 rollouts), runs; at fp32 the
    replayed ratios are 1 (k3 ~ 0, where the unrenormalized ones would carry log pi(S)) and the diagnostics use the
    corrector's C = 4."""
    import csv

    out = tmp_path / "run"
    args = [*SMOKE, "algorithm.top_p=0.9", "corrector=ais", "logger=csv", *extra]
    run_train([*args, f"hydra.run.dir={out}"], cwd=tmp_path)
    rows = [r for r in csv.DictReader(next(out.rglob("metrics.csv")).open()) if r.get("mismatch/kl_k3")]
    assert len(rows) == 2
    for row in rows:
        kl, top = float(row["mismatch/kl_k3"]), float(row["mismatch/ratio_max"])
        assert math.isfinite(kl) and math.isfinite(float(row["ais/lambda"]))
        if extra:
            assert kl < 1e-9 and abs(top - 1.0) < 1e-4
            assert float(row["mismatch/ais_lambda"]) == pytest.approx(float(row["ais/lambda"]), abs=1e-6)


def test_moe_policy_with_int8_rollouts_and_router_replay(tmp_path: Path):
    """Issue 36's acceptance command: the tiny MoE, quantized experts, routing replay, disagreement logged."""
    import csv

    out = tmp_path / "run"
    args = [*SMOKE, "policy=tiny_qwen3_moe", "rollout=int8", "policy.router_replay=true", "logger=csv"]
    proc = run_train([*args, f"hydra.run.dir={out}"], cwd=tmp_path)
    assert f"TorchRolloutEngine int8 (backend {default_int8_backend()}: " in proc.stdout
    assert "; transformers forward)" in proc.stdout
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("routing/disagreement")]
    assert len(logged) == 2  # one per rollout step, beside the mismatch KL
    for row in logged:
        assert 0.0 <= float(row["routing/disagreement"]) < 1.0
        assert math.isfinite(float(row["mismatch/kl_k3"]))
        assert "routing/disagreement_layer3" in row


def test_moe_router_replay_under_fsdp2(tmp_path: Path):
    """The same command on trainer=fsdp2 (2 CPU processes, gloo): every rank records, replays and logs routing."""
    import csv

    out = tmp_path / "run"
    args = [*SMOKE, "trainer=fsdp2", "trainer.max_steps=2", "policy=tiny_qwen3_moe", "rollout=int8"]
    run_train([*args, "policy.router_replay=true", "logger=csv", f"hydra.run.dir={out}"], cwd=tmp_path)
    rows = list(csv.DictReader(next(out.rglob("metrics.csv")).open()))
    logged = [float(r["routing/disagreement"]) for r in rows if r.get("routing/disagreement")]
    assert len(logged) == 2 and all(0.0 <= v < 1.0 for v in logged)


def test_moe_router_replay_resumes_with_the_same_metrics(tmp_path: Path):
    """A resumed MoE run (int8 experts, their outlier calibration in the checkpoint, routing replay) reproduces the
    uninterrupted one step for step."""
    common = [*SMOKE, "policy=tiny_qwen3_moe", "rollout=int8", "policy.router_replay=true", "logger=none"]
    four_steps = [*common, "trainer.checkpoint_every_n_steps=1", "trainer.max_steps=4"]
    full = tmp_path / "full"
    run_train([*four_steps, f"hydra.run.dir={full}"], cwd=tmp_path)
    expected = json.loads((full / "history.json").read_text())
    step2 = full / "checkpoints" / "step000002.ckpt"
    resumed = tmp_path / "resumed"
    run_train([*four_steps, f"hydra.run.dir={resumed}", f"ckpt_path={step2}"], cwd=tmp_path)
    got = json.loads((resumed / "history.json").read_text())
    assert [h["step"] for h in got] == [h["step"] for h in expected] and len(got) == 4
    for a, b in zip(got, expected):
        for key in ("reward", "kl_k3", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)
