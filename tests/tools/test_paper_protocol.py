"""tools/paper_protocol.py without running a sweep: the commands it builds, its argument checks, --dry-run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.tools.load_tool import TOOLS, load_tool

pp = load_tool("paper_protocol")
URI = "http://127.0.0.1:5055"
J = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"logger.tracking_uri={URI}"]


@pytest.fixture
def fast_names(monkeypatch):
    """Skip composing the presets (seconds each): the MLflow experiment name = the preset name."""
    monkeypatch.setattr(pp, "experiment_name", lambda preset, overrides: preset)


def _sweeps(commands: list[list[str]]) -> list[list[str]]:
    """The ais-train commands, without the executable."""
    prefix = pp.ais_train()
    return [cmd[len(prefix) :] for cmd in commands if cmd[: len(prefix)] == prefix]


def test_ais_train_is_the_console_script_next_to_this_interpreter(monkeypatch, tmp_path):
    assert pp.ais_train() == [str(Path(sys.executable).parent / "ais-train")]
    monkeypatch.setattr(pp.sys, "executable", str(tmp_path / "python"))
    assert pp.ais_train() == [str(tmp_path / "python"), "-m", "ais_lightning.app.train"]


def test_the_default_commands_are_the_documented_ones(tmp_path):
    args = pp.parse_args(["--out", str(tmp_path)])  # composes both presets for their experiment names
    commands = pp.protocol_commands(args, URI)
    assert len(commands) == 2 * (3 + 2)
    expected = []
    for exp in ("paper_small", "paper_sudoku4"):
        runs = tmp_path / exp / "multirun"
        expected += [
            ["-m", f"experiment={exp}", "rollout=fp32", "corrector=none", "seed=0,1,2,3,4", *J],
            [
                "-m",
                f"experiment={exp}",
                "rollout=fp4",
                "corrector=none,tis,mis,ais_v1,ais",
                "seed=0,1,2,3,4",
                *J,
            ],
            [
                "-m",
                f"experiment={exp}",
                "rollout=int8,fp8",
                "corrector=none,tis,mis,ais_v1,ais",
                "seed=0,1,2",
                *J,
            ],
        ]
        for cmd, sweep in zip(expected[-3:], ("baseline", "many-seeds", "precisions")):
            cmd.append(f"hydra.sweep.dir={runs / sweep}")
    assert _sweeps(commands) == expected

    for i, exp in enumerate(("paper_small", "paper_sudoku4")):
        report, claims = commands[5 * i + 3], commands[5 * i + 4]
        assert report == [
            sys.executable,
            str(TOOLS / "sweep_report.py"),
            *("--tracking-uri", URI, "--experiment", exp, "--baseline", "fp32"),
            *("--out", str(tmp_path / exp / "report")),
            *("--metric-map", "val_accuracy=val/accuracy_trainer", "--plot", "ais/lambda"),
            *("--plot", "ais/variance_amplification", "--plot", "val/accuracy_engine"),
        ]
        report_json = str(tmp_path / exp / "report" / "report.json")
        assert claims == [
            sys.executable,
            str(TOOLS / "paper_claims.py"),
            report_json,
            "--lambda-key",
            "ais_lambda",
            "--lambda-plot",
            str(tmp_path / exp / "report" / "lambda_regimes.png"),
        ]
    steps = pp.protocol_steps(args, URI)
    assert steps[4].stdout == tmp_path / "paper_small" / "claims.md"
    assert [s.log for s in steps[:3]] == [
        tmp_path / "paper_small" / "logs" / f"{n}.log" for n in ("baseline", "many-seeds", "precisions")
    ]


def test_extra_correctors_run_only_at_the_many_seeds_precisions(tmp_path, fast_names):
    args = pp.parse_args(
        ["--out", str(tmp_path), "--experiments", "paper_small", "--extra-correctors", "ais_one_step"]
    )
    baseline, fp4, others = _sweeps(pp.protocol_commands(args, URI))
    assert "rollout=fp4" in fp4 and "corrector=none,tis,mis,ais_v1,ais,ais_one_step" in fp4
    assert "corrector=none,tis,mis,ais_v1,ais" in others and "corrector=none" in baseline


def test_empty_precisions_drop_that_sweep_and_overrides_reach_every_sweep(tmp_path, fast_names):
    argv = ["--out", str(tmp_path), "--experiments", "paper_smoke", "--many-seeds", "0"]
    argv += ["--many-seeds-precisions", "int8", "--precisions", "", "--correctors", "none,ais", "--jobs", "3"]
    args = pp.parse_args([*argv, "--plot", "mismatch/ais_lambda", "--", "trainer.max_steps=3"])
    commands = pp.protocol_commands(args, URI)
    assert [s[2:5] for s in _sweeps(commands)] == [
        ["rollout=fp32", "corrector=none", "seed=0"],
        ["rollout=int8", "corrector=none,ais", "seed=0"],
    ]
    assert all(s[-1] == "trainer.max_steps=3" and "hydra.launcher.n_jobs=3" in s for s in _sweeps(commands))
    assert commands[2][-2:] == ["--plot", "mismatch/ais_lambda"] and "trainer.max_steps=3" not in commands[2]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--experiments", "paper_small,paper_big"], ["--experiments", "paper_big"]),
        (["--precisions", "int8,fp5"], ["--precisions", "fp5"]),
        (["--many-seeds-precisions", "fp3"], ["--many-seeds-precisions", "fp3"]),
        (["--baseline", "fp64"], ["--baseline", "fp64"]),
        (["--correctors", "none,tiss"], ["--correctors", "tiss"]),
        (["--extra-correctors", "ais_two_step"], ["--extra-correctors", "ais_two_step"]),
        (["--correctors", ""], ["--correctors"]),
        (["--many-seeds", ""], ["--many-seeds"]),
        (["--seeds", "0,one"], ["--seeds", "one"]),
        (["--seeds", ""], ["--seeds"]),
        (["--jobs", "0"], ["--jobs"]),
        (["--", "seed=7"], ["seed=7"]),
        (["--", "hydra.sweep.dir=/tmp/x"], ["hydra.sweep.dir"]),
    ],
)
def test_bad_arguments_are_rejected_naming_the_option(tmp_path, capsys, fast_names, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        pp.main(["--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(word in err for word in named), err
    assert not (tmp_path / "out").exists()


def test_a_store_left_by_an_earlier_protocol_is_refused(tmp_path, capsys, fast_names):
    (tmp_path / "mlflow.db").touch()
    with pytest.raises(SystemExit):
        pp.main(["--out", str(tmp_path), "--experiments", "paper_smoke"])
    assert "already holds an MLflow store" in capsys.readouterr().err


def test_dry_run_prints_the_commands_and_starts_nothing(tmp_path, capsys, monkeypatch, fast_names):
    def no_process(*args, **kwargs):
        raise AssertionError("--dry-run started a process")

    monkeypatch.setattr(pp.subprocess, "Popen", no_process)
    monkeypatch.setattr(pp.subprocess, "run", no_process)
    out = tmp_path / "out"
    assert (
        pp.main(["--out", str(out), "--experiments", "paper_small", "--dry-run", "--", "trainer.max_steps=5"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == shlex.join(pp.server_command(out, "PORT")) + " &"
    args = pp.parse_args(["--out", str(out), "--experiments", "paper_small", "--", "trainer.max_steps=5"])
    assert lines[1:] == [shlex.join(cmd) for cmd in pp.protocol_commands(args, "http://127.0.0.1:PORT")]
    assert not out.exists()


def test_a_failed_sweep_stops_the_protocol_naming_its_command_and_log(
    tmp_path, capsys, monkeypatch, fast_names
):
    fail = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    monkeypatch.setattr(pp, "ais_train", lambda: fail)
    out = tmp_path / "out"
    code = pp.main(["--out", str(out), "--experiments", "paper_small", "--tracking-uri", URI])
    captured = capsys.readouterr()
    assert code == 1
    log = out / "paper_small" / "logs" / "baseline.log"
    assert "paper_small/baseline failed (exit 3)" in captured.err and str(log) in captured.err
    assert "rollout=fp32" in captured.err and log.read_text().strip() == "boom"
    assert not (out / "paper_small" / "logs" / "many-seeds.log").exists(), "nothing runs after a failure"
    assert "wall time:" in captured.out and "paper_small/baseline" in captured.out
