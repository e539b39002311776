"""OpenMP's wait policy for a benchmark process, chosen before torch loads (import this module
before ``torch``; libgomp reads the policy once, when torch loads it).

By default the policy ``fedloom run`` runs under: ``OMP_WAIT_POLICY=PASSIVE``, which
``import fedloom`` sets when torch is not yet loaded and the user set none of the wait
variables (engine/threads.py). A script that imports torch first would otherwise keep
libgomp's default spinning (``GOMP_SPINCOUNT=300000``), under which in-process 2-thread
candidates run faster on a quiet machine than any ``fedloom run`` does (benchmarks/README.md,
"`roofline.py` under fedloom's wait policy"). ``--omp-spin`` on the command line chooses that
default spinning instead (what a plain PyTorch script such as pfl's runs under); a wait
variable the user set wins over both.
"""

from __future__ import annotations

import os
import sys

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_FLAG = "--omp-spin"

LATE = "torch" in sys.modules
"""torch loaded before this module (a script importing it after torch): nothing is set here,
and OpenMP keeps what it read then."""
if not LATE:
    if SPIN_FLAG in sys.argv[1:]:
        os.environ.setdefault("GOMP_SPINCOUNT", "300000")
    if not any(v in os.environ for v in WAIT_VARS):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

POLICY = (
    "as read when torch loaded, before openmp_policy (libgomp's default spinning unless the "
    "environment chose one)"
    if LATE
    else ",".join(f"{v}={os.environ[v]}" for v in WAIT_VARS if v in os.environ)
)
"""The wait settings this process runs under, for reports."""
