"""The GPU smoke checks, printed PASS / FAIL / SKIP per check with a JSON summary; exit status 1 when one fails.

Run through ``tools/gpu_smoke.sh`` on a fresh GPU machine (it installs the GPU stack first), or directly in an
environment that has it::

    python tools/gpu_smoke.py                 # on cuda:0, within 8 minutes (--budget-s)
    python tools/gpu_smoke.py --with-te       # also Transformer Engine
    python tools/gpu_smoke.py --dry           # every check on the CPU through stand-ins (what CI runs)
    python tools/gpu_smoke.py --only vllm_parity --json smoke.json

The checks and what a PASS of each proves: ``ais_lightning.toolkit.gpu_smoke.checks`` and docs/gpu.md.
"""

from __future__ import annotations

import sys

from ais_lightning.toolkit.gpu_smoke import main

if __name__ == "__main__":
    sys.exit(main())
