"""Run the paper protocol of docs/results.md as one command: the sweeps, the sweep report, the claims check.

Usage:
  .venv/bin/python tools/paper_protocol.py --out paper_rerun
  .venv/bin/python tools/paper_protocol.py --out rerun --experiments paper_sudoku4 \\
      --many-seeds 5,6,7,8,9 --seeds 5,6,7 -- trainer.max_steps=50
  .venv/bin/python tools/paper_protocol.py --out paper_rerun --dry-run      # print the commands only

For each experiment preset E, with S = --many-seeds and s = --seeds, in this order:
  ais-train -m experiment=E rollout=BASELINE corrector=none seed=S $J
  ais-train -m experiment=E rollout=MANY_SEEDS_PRECISIONS corrector=CORRECTORS,EXTRA_CORRECTORS seed=S $J
  ais-train -m experiment=E rollout=PRECISIONS corrector=CORRECTORS seed=s $J    (skipped if no PRECISIONS)
  tools/sweep_report.py --experiment <E's logger.experiment_name> --metric-map val_accuracy=val/accuracy_trainer \\
      --plot ais/lambda --plot ais/variance_amplification --plot val/accuracy_engine ...
  tools/paper_claims.py E/report/report.json --lambda-key ais_lambda --lambda-plot E/report/lambda_regimes.png
where J = hydra/launcher=joblib hydra.launcher.n_jobs=JOBS logger.tracking_uri=URI hydra.sweep.dir=...,
then the overrides given after `--`.

Writes under --out: mlflow.db, mlartifacts/ and mlflow-server.log (the local MLflow server's store; not
with --tracking-uri), and per experiment E: E/multirun/{baseline,many-seeds,precisions}/ (Hydra's
multirun dirs), E/logs/<step>.log (each command's output), E/report/ (report.md, report.json, PNGs) and
E/claims.md (paper_claims' output). A failed command stops the protocol; the runs it and the earlier
sweeps logged stay in the store. Every run of an experiment in the store is averaged by the report, so
start each protocol in a new --out (it refuses one that already holds a store).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ais_lightning.app.config import CONFIG_DIR
from ais_lightning.toolkit.mlflow_server import STORE, local_mlflow_server, server_command

TOOLS = Path(__file__).resolve().parent
REPORT_ARGS = ["--metric-map", "val_accuracy=val/accuracy_trainer"]
REPORT_PLOTS = ["ais/lambda", "ais/variance_amplification", "val/accuracy_engine"]
LAMBDA_KEY = "ais_lambda"
MANAGED_KEYS = {  # set by the protocol on every ais-train command: not accepted after `--`
    "experiment",
    "rollout",
    "corrector",
    "seed",
    "hydra/launcher",
    "hydra.launcher.n_jobs",
    "hydra.sweep.dir",
    "logger.tracking_uri",
}


@dataclass
class Step:
    """One command of the protocol: ``argv`` with its output in ``log`` (stdout in ``stdout`` if set)."""

    name: str
    argv: list[str]
    log: Path
    stdout: Path | None = None


def options(group: str) -> list[str]:
    """The option names of a config group: the stems of ``ais_lightning/app/conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def ais_train() -> list[str]:
    """The ``ais-train`` console script next to this interpreter, else ``python -m ais_lightning.app.train``."""
    script = Path(sys.executable).parent / "ais-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ais_lightning.app.train"]


def experiment_name(preset: str, overrides: list[str]) -> str:
    """The MLflow experiment ``ais-train experiment=PRESET OVERRIDES`` logs into (its ``logger.experiment_name``).

    Composing also checks the overrides before anything runs (Hydra's own ``hydra.*`` keys are skipped)."""
    from ais_lightning.app.config import compose_train_config

    config_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    cfg = compose_train_config([f"experiment={preset}", "output_dir=unused", *config_overrides])
    return str(cfg.logger.experiment_name)


def protocol_steps(args: argparse.Namespace, uri: str) -> list[Step]:
    """Every command of the protocol, in order; ``args.names`` maps each preset to its MLflow experiment."""
    # sweep name: (rollouts, correctors, seeds); a sweep without rollouts is skipped
    sweeps = {
        "baseline": ([args.baseline], ["none"], args.many_seeds),
        "many-seeds": (args.many_seeds_precisions, args.correctors + args.extra_correctors, args.many_seeds),
        "precisions": (args.precisions, args.correctors, args.seeds),
    }
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}", f"logger.tracking_uri={uri}"]
    plots = [a for key in REPORT_PLOTS + args.plot for a in ("--plot", key)]
    steps = []
    for exp in args.experiments:
        root, logs = args.out / exp, args.out / exp / "logs"
        for name, (rollouts, correctors, seeds) in sweeps.items():
            if rollouts:
                argv = [*ais_train(), "-m", f"experiment={exp}", f"rollout={','.join(rollouts)}"]
                argv += [f"corrector={','.join(correctors)}", f"seed={','.join(map(str, seeds))}", *launcher]
                argv += [f"hydra.sweep.dir={root / 'multirun' / name}", *args.overrides]
                steps.append(Step(f"{exp}/{name}", argv, logs / f"{name}.log"))
        # The two tools run as their own processes rather than through their main(argv): this driver stays
        # light (no mlflow / matplotlib import; --help and --dry-run stay quick), paper_claims' stdout goes
        # straight into claims.md, every step fails the same way (exit status + its log), and the progress
        # lines show commands one can copy, as docs/results.md lists them.
        report = [sys.executable, str(TOOLS / "sweep_report.py"), "--tracking-uri", uri]
        report += ["--experiment", args.names[exp], "--baseline", args.baseline]
        report += ["--out", str(root / "report")]
        steps.append(Step(f"{exp}/report", report + REPORT_ARGS + plots, logs / "report.log"))
        claims = [sys.executable, str(TOOLS / "paper_claims.py"), str(root / "report" / "report.json")]
        claims += ["--lambda-key", LAMBDA_KEY, "--lambda-plot", str(root / "report" / "lambda_regimes.png")]
        steps.append(Step(f"{exp}/claims", claims, logs / "claims.log", stdout=root / "claims.md"))
    return steps


def protocol_commands(args: argparse.Namespace, uri: str) -> list[list[str]]:
    """The argv of every command of the protocol, in order."""
    return [step.argv for step in protocol_steps(args, uri)]


class StepFailed(RuntimeError):
    pass


def run_step(step: Step) -> None:
    """Run ``step`` with its output in its log file, on one progress line; StepFailed on a nonzero exit."""
    step.log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"[{datetime.datetime.now():%H:%M:%S}] {step.name}: {shlex.join(step.argv)}", end="", flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the URI is on the command line
    with open(step.log, "w") as log, open(step.stdout or os.devnull, "w") as out:
        # In its own process group (joblib's workers included), which gets one SIGINT on Ctrl+C or SIGTERM
        # here: Hydra ends the sweep, whose finished runs are logged; SIGKILL after 60 s.
        proc = subprocess.Popen(
            step.argv, stdout=out if step.stdout else log, stderr=log, env=env, start_new_session=True
        )
        try:
            code = proc.wait()
        except BaseException:
            print()
            for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
            raise
    elapsed = time.monotonic() - start
    print(f"  ({_duration(elapsed)})", flush=True)
    if code != 0:
        raise StepFailed(
            f"{step.name} failed (exit {code}): {shlex.join(step.argv)}\n  its output: {step.log}"
        )


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _list(text: str) -> list[str]:
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paper_protocol.py",
        usage="%(prog)s --out DIR [options] [-- AIS_TRAIN_OVERRIDE ...]",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lists = [  # flag, default, help: comma-separated lists
        ("--experiments", "paper_small,paper_sudoku4", "experiment presets (default %(default)s)"),
        ("--many-seeds", "0,1,2,3,4", "seeds of the baseline and --many-seeds-precisions (%(default)s)"),
        ("--many-seeds-precisions", "fp4", "rollouts run with --many-seeds (default %(default)s)"),
        ("--precisions", "int8,fp8", "rollouts run with --seeds; '' skips that sweep (default %(default)s)"),
        ("--seeds", "0,1,2", "seeds of --precisions (default %(default)s)"),
        ("--correctors", "none,tis,mis,ais_v1,ais", "correctors of both sweeps (default %(default)s)"),
        ("--extra-correctors", "", "more correctors, run only at --many-seeds-precisions, e.g. ais_one_step"),
    ]
    add = parser.add_argument
    add("--out", type=Path, required=True, metavar="DIR", help="output directory (created; see below)")
    add("--baseline", default="fp32", metavar="ROLLOUT", help="run with corrector=none (default %(default)s)")
    for flag, default, text in lists:
        metavar = "SEEDS" if flag.endswith("seeds") else "LIST"
        add(flag, type=_list, default=default, metavar=metavar, help=text)
    add("--jobs", type=int, default=2, metavar="N", help="parallel jobs per sweep (joblib; default 2)")
    add("--tracking-uri", metavar="URI", help="an MLflow server (default: start one, its store under --out)")
    add("--plot", action="append", default=[], metavar="KEY", help="another metric for the report to plot")
    add("--dry-run", action="store_true", help="print the commands and exit")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv`` (argparse errors name the bad option); ``args.overrides`` = after ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1 :]
    checks = [
        ("--experiments", "experiment", args.experiments),
        ("--baseline", "rollout", [args.baseline]),
        ("--many-seeds-precisions", "rollout", args.many_seeds_precisions),
        ("--precisions", "rollout", args.precisions),
        ("--correctors", "corrector", args.correctors),
        ("--extra-correctors", "corrector", args.extra_correctors),
    ]
    for flag, group, names in checks:
        unknown = [n for n in names if n not in options(group)]
        if unknown:
            parser.error(
                f"{flag}: unknown {group} option(s) {', '.join(unknown)}; known: {', '.join(options(group))}"
            )
    for flag in ("--experiments", "--correctors", "--many-seeds"):
        if not getattr(args, flag[2:].replace("-", "_")):
            parser.error(f"{flag} must not be empty")
    if args.precisions and not args.seeds:
        parser.error("--seeds must not be empty when --precisions is not")
    for flag in ("--many-seeds", "--seeds"):
        attr = flag[2:].replace("-", "_")
        try:
            setattr(args, attr, [int(s) for s in getattr(args, attr)])
        except ValueError:
            parser.error(f"{flag}: seeds are integers, got {','.join(getattr(args, attr))}")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    for override in args.overrides:
        if override.split("=")[0].lstrip("+~") in MANAGED_KEYS or override in ("-m", "--multirun"):
            parser.error(f"override {override!r} after --: the protocol sets it itself (see its options)")
    args.out = args.out.resolve()
    args.names = {}
    for exp in args.experiments:
        try:
            args.names[exp] = experiment_name(exp, args.overrides)
        except Exception as err:  # Hydra's composition errors
            overrides = f" with the overrides after -- ({' '.join(args.overrides)})" if args.overrides else ""
            parser.error(f"experiment={exp}{overrides} does not compose: {err}")
    if not args.dry_run and args.tracking_uri is None and (args.out / STORE).exists():
        parser.error(
            f"--out {args.out} already holds an MLflow store from an earlier protocol: the report would "
            "average its runs with the new ones. Choose a new --out (or pass --tracking-uri on purpose)."
        )
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        uri = args.tracking_uri or "http://127.0.0.1:PORT"
        if not args.tracking_uri:
            print(shlex.join(server_command(args.out, "PORT")) + " &")
        for cmd in protocol_commands(args, uri):
            print(shlex.join(cmd))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a kill also stops the server and the sweep
    times: list[tuple[str, float]] = []
    start = time.monotonic()
    step = None
    store = args.tracking_uri or args.out / STORE
    try:
        with contextlib.ExitStack() as stack:
            uri = args.tracking_uri or stack.enter_context(local_mlflow_server(args.out))
            print(f"MLflow: {uri}" + ("" if args.tracking_uri else f", store {store}"))
            for step in protocol_steps(args, uri):
                step_start = time.monotonic()
                try:
                    run_step(step)
                finally:
                    times.append((step.name, time.monotonic() - step_start))
    except RuntimeError as err:  # a failed step, or the server did not start
        print(f"paper_protocol: error: {err}\n  the runs logged so far stay in {store}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        where = f" during {step.name} (its output: {step.log})" if step else ""
        print(f"paper_protocol: interrupted{where}; the runs logged so far stay in {store}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        _summary(times, time.monotonic() - start)
    print("reports:")
    for exp in args.experiments:
        print(f"  {exp}: {args.out / exp / 'report' / 'report.md'}, {args.out / exp / 'claims.md'}")
    return 0


def _summary(times: list[tuple[str, float]], total: float) -> None:
    if not times:
        return
    width = max(len(name) for name, _ in times)
    print("wall time:")
    for name, seconds in times:
        print(f"  {name:<{width}}  {_duration(seconds)}")
    print(f"  {'total':<{width}}  {_duration(total)}")


if __name__ == "__main__":
    sys.exit(main())
