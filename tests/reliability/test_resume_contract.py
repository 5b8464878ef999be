"""Resume as a contract, one run per directory, store URIs from any path (issue 45, cases 3-7 and 12).

One finished 2-step run, made once in a directory whose name holds ``?``, ``#``, ``%41``, spaces and non-ASCII
(case 7: ``?`` cut the SQLite path, ``%41`` was decoded), is copied for each test, which then resumes or
restarts the copy:

- case 3: a resume with another corrector failed inside ``fit`` on Lightning's "Unexpected key(s) in
  state_dict" and turned the FINISHED run FAILED; now refused first, naming the corrector and its state keys;
- case 4: a resume that changed the lr, the group size and the rollout precision was accepted silently, MLflow
  keeping the old params (and Lightning the old lr); now it starts a new MLflow run linked to the old one, with
  the new params, training with the new lr;
- case 5: two runs in one directory at once both ran; now the second is refused naming the first;
- case 6: a fresh run in a directory with checkpoints replaced them silently; now refused unless
  ``overwrite=true``;
- case 12: a copied run directory resumed into the original's store.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ais_lightning.files import verify_file
from tests.reliability.runs import SMOKE, Run, metric_by_step, mlflow_runs, read_json

pytestmark = pytest.mark.slow

COMMON = [*SMOKE, "trainer.checkpoint_every_n_steps=1", "logger=mlflow"]
ODD_NAME = "run ?x=1 #frag %41 ünï"
"""A run directory name with every character a URL parser reads: query, fragment, escape, space, non-ASCII."""


def at(directory: Path, *overrides: str) -> list[str]:
    return [*COMMON, f"output_dir='{directory}'", *overrides]


@pytest.fixture(scope="module")
def finished(in_process, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (corrector=ais, MLflow on its default store) in a directory named :data:`ODD_NAME`."""
    out = tmp_path_factory.mktemp("finished") / ODD_NAME
    in_process(at(out))
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def only_run(directory: Path):
    (record,) = mlflow_runs(directory / "mlflow.db")
    return record


def test_the_store_of_a_run_dir_with_any_characters_is_the_file_in_it(finished: Path):
    """Case 7: the store is ``<run dir>/mlflow.db`` itself, its run FINISHED, and nothing was made elsewhere."""
    record = only_run(finished)
    assert record.info.status == "FINISHED"
    assert sorted(p.name for p in finished.parent.iterdir()) == [ODD_NAME]  # no truncated or quoted twin
    summary = read_json(finished / "summary.json")
    assert summary["status"] == "finished"
    assert list(metric_by_step(finished / "mlflow.db", record.info.run_id, "reward/mean")) == [0, 1]


def test_another_corrector_is_refused_naming_its_state_and_the_run_stays_finished(
    finished: Path, in_process, tmp_path: Path
):
    run = copy_of(finished, tmp_path)
    before = only_run(run)
    config = (run / "config.yaml").read_text()
    with pytest.raises(ValueError) as err:
        in_process(at(run, "ckpt_path=last", "trainer.max_steps=3", "corrector=tis"))
    message = str(err.value)
    assert "cannot continue the checkpoint's run: the state of corrector does not fit" in message, message
    assert "corrector.ema_lambda (in the checkpoint only)" in message, message
    assert (
        "corrector._target_: 'ais_lightning.correctors.ais.AIS' -> 'ais_lightning.correctors.tis.TIS'"
        in message
    )
    assert len(message) < 1200, "a few keys, not the whole state dict"
    after = only_run(run)
    assert after.info.status == "FINISHED" and after.data.params == before.data.params
    assert after.data.tags == before.data.tags
    assert (run / "config.yaml").read_text() == config


def test_a_changed_recipe_continues_in_a_new_linked_run_with_its_own_params(
    finished: Path, in_process, tmp_path: Path
):
    run = copy_of(finished, tmp_path)
    old = only_run(run)
    changes = ["algorithm.lr=1e-4", "algorithm.group_size=2", "rollout=fp8"]
    summary = in_process(at(run, "ckpt_path=last", "trainer.max_steps=3", *changes))
    assert summary["status"] == "finished" and summary["steps"] == 3
    records = {r.info.run_id: r for r in mlflow_runs(run / "mlflow.db")}
    assert len(records) == 2
    kept, (new,) = records.pop(old.info.run_id), records.values()
    assert kept.info.status == "FINISHED" and kept.data.params == old.data.params  # the old run as it was
    assert list(metric_by_step(run / "mlflow.db", kept.info.run_id, "reward/mean")) == [0, 1]
    assert new.info.status == "FINISHED"
    assert new.data.tags["resumed_from_run"] == old.info.run_id and new.data.tags["resumed_from_step"] == "2"
    for key in (
        "algorithm.lr: 3e-05 -> 0.0001",
        "algorithm.group_size: 4 -> 2",
        "rollout.precision: 'int8' -> 'fp8'",
    ):
        assert key in new.data.tags["config_changes"], new.data.tags["config_changes"]
    assert (new.data.params["algorithm.lr"], new.data.params["algorithm.group_size"]) == ("0.0001", "2")
    assert new.data.params["rollout.precision"] == "fp8" and old.data.params["rollout.precision"] == "int8"
    assert list(metric_by_step(run / "mlflow.db", new.info.run_id, "reward/mean")) == [2]
    step3 = torch.load(run / "checkpoints" / "step000003.ckpt", map_location="cpu", weights_only=False)
    assert step3["optimizer_states"][0]["param_groups"][0]["lr"] == 1e-4, "Lightning restored the old lr"

    summary = in_process(at(run, "ckpt_path=last", "trainer.max_steps=4", *changes))  # only longer: same run
    assert summary["steps"] == 4
    (continued,) = [r for r in mlflow_runs(run / "mlflow.db") if r.info.run_id == new.info.run_id]
    assert continued.data.tags["config_changes_at_step_3"] == "trainer.max_steps: 3 -> 4"
    assert list(metric_by_step(run / "mlflow.db", new.info.run_id, "reward/mean")) == [2, 3]


def test_a_fresh_run_over_checkpoints_is_refused_unless_asked_to_overwrite(
    finished: Path, in_process, tmp_path: Path
):
    run = copy_of(finished, tmp_path)
    old = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(ValueError) as err:
        in_process(at(run, "trainer.max_steps=1"))
    message = str(err.value)
    assert "already holds checkpoints of a run (checkpoints/last.ckpt" in message, message
    assert "ckpt_path=last" in message and "overwrite=true" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == old  # untouched
    in_process(at(run, "trainer.max_steps=1", "overwrite=true"))
    names = ["last.ckpt", "step000001.ckpt"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        [*names, *(n + ".sha256" for n in names)]
    )
    assert (
        torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
        == 1
    )


def test_a_copied_run_directory_resumes_into_its_own_store(finished: Path, in_process, tmp_path: Path):
    """Case 12: the copy's checkpoint records the original's store; the resume wrote there. (Every test here
    resumes a copy: the original keeps its own 2 steps.)"""
    run = copy_of(finished, tmp_path)
    in_process(at(run, "ckpt_path=last", "trainer.max_steps=3"))
    record = only_run(run)
    assert record.info.status == "FINISHED"
    assert list(metric_by_step(run / "mlflow.db", record.info.run_id, "reward/mean")) == [0, 1, 2]
    assert list(metric_by_step(finished / "mlflow.db", record.info.run_id, "reward/mean")) == [0, 1]
    assert only_run(finished).info.status == "FINISHED"


def test_a_second_run_in_a_busy_directory_is_refused_naming_the_first(in_process, tmp_path: Path):
    """Case 5: two runs in one ``hydra.run.dir`` at once (a real process, then one in this process)."""
    out = tmp_path / "run"
    first = Run([*COMMON, "trainer.max_steps=3", f"hydra.run.dir={out}"], tmp_path, log_name="first")
    first.wait_for(out / "mlflow.db")  # built after the policy: the first run is well under way
    with pytest.raises(ValueError) as err:
        in_process([*COMMON, f"output_dir={out}"])
    message = str(err.value)
    assert f"output_dir {out} is in use by another ais-train run (pid {first.proc.pid} on host" in message, (
        message
    )
    first.expect(0)
    assert read_json(out / "summary.json")["steps"] == 3
    for path in (out / "checkpoints").glob("*.ckpt"):
        verify_file(path)
    assert only_run(out).info.status == "FINISHED"
