"""Real ``ais-train`` processes for the fault-injection tests: start, kill, wait, read what they left."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.integration.helpers import local_env

REPO = Path(__file__).resolve().parents[2]

SMOKE = ["experiment=smoke", "trainer.num_threads=1"]
"""A seconds-long run: tiny model, no warm start, 2 rollout steps of 4 prompts x 4 samples."""

TRAIN = "ais_lightning.app.train"
"""``python -m ais_lightning.app.train``: ``ais-train`` itself."""
TIMED = "tests.reliability.faults"
"""``ais-train`` with its libraries imported first; prints ``RUN_SECONDS=`` (see faults.py)."""


def _sigint_as_a_terminal_sends_it() -> None:
    """In the child: SIGINT back to its default (Python's KeyboardInterrupt). A test suite started as a shell's
    background job (``make test &``) inherits SIGINT ignored, and so would every run it starts: Ctrl-C would then
    never reach them, whatever the run does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """One ``python -m <module> ARGS`` process; its stdout and stderr go to files beside ``log_dir``."""

    def __init__(
        self,
        args: list[str],
        cwd: Path,
        module: str = TRAIN,
        env: dict[str, str] | None = None,
        log_name: str | None = None,
    ) -> None:
        self.args = args
        name = log_name or f"proc-{time.monotonic_ns()}"
        self.out_path, self.err_path = cwd / f"{name}.out", cwd / f"{name}.err"
        full_env = local_env(
            {
                "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1",
                "AIS_LIGHTNING_CACHE": str(cwd / "cache"),
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            }
        )
        full_env.pop("MLFLOW_TRACKING_URI", None)
        full_env.update(env or {})
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(  # its own process group: a timeout ends it and whatever it started
                [sys.executable, "-m", module, *args],
                cwd=cwd,
                env=full_env,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_sigint_as_a_terminal_sends_it,
            )

    def wait(self, timeout: float = 600) -> int:
        """The exit code (negative: killed by that signal); on timeout the process is killed and the test fails."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(
                f"ais-train {' '.join(self.args)} was still running after {timeout:.0f} s:\n{self.output[-3000:]}"
            ) from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def wait_for(self, path: Path, timeout: float = 600) -> None:
        """Poll until ``path`` exists; fails if the process ends first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"ais-train ended (exit {self.proc.returncode}) before {path} appeared:\n{self.output[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not appear within {timeout:.0f} s")
            time.sleep(0.05)

    def expect(self, code: int = 0, timeout: float = 600) -> Run:
        """Wait and check the exit code, showing the output when it differs."""
        rc = self.wait(timeout)
        assert rc == code, (
            f"ais-train {' '.join(self.args)} exited {rc}, expected {code}:\n{self.output[-6000:]}"
        )
        return self


def train(args: list[str], cwd: Path, module: str = TRAIN, timeout: float = 600, **kwargs: Any) -> Run:
    """Run to the end (a failing exit code is the caller's to check)."""
    run = Run(args, cwd, module=module, **kwargs)
    run.wait(timeout)
    return run


def run_seconds(stderr: str) -> float:
    """How long the run took after its imports (printed by ``tests.reliability.faults``)."""
    match = re.search(r"RUN_SECONDS=([0-9.]+)", stderr)
    assert match, f"no RUN_SECONDS line in:\n{stderr[-3000:]}"
    return float(match.group(1))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def store_uri(db: Path) -> str:
    """The ``sqlite:///`` URI of the store file ``db``, its path quoted (any character in a run directory)."""
    from urllib.parse import quote

    return "sqlite:///" + quote(str(Path(db).absolute()))


def mlflow_runs(db: Path, experiment: str = "ais_lightning") -> list[Any]:
    """Every run of ``experiment`` in the SQLite store ``db`` (oldest first)."""
    from mlflow.tracking import MlflowClient

    assert db.exists(), f"no MLflow store at {db}"
    client = MlflowClient(tracking_uri=store_uri(db))
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {db}"
    return sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def metric_by_step(db: Path, run_id: str, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric's history, the value logged last at each step (as the sweep report reads it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri(db))
    out: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in out or m.timestamp >= out[m.step][0]:
            out[m.step] = (m.timestamp, m.value)
    return {step: value for step, (_, value) in sorted(out.items())}


def user_conf(root: Path, files: dict[str, str]) -> Path:
    """A config directory for ``hydra.searchpath``: ``{"rollout/x.yaml": "..."}`` -> ``root/conf/...``."""
    conf = root / "conf"
    for rel, text in files.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    return conf


NOISE = ("manual optimization", "LeafSpec", "litlogger")
"""Fragments of the third-party messages ``ais_lightning.app.noise`` silences (none may reach the output)."""
