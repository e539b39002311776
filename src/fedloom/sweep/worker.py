"""One run of a sweep in its own process: ``python -m fedloom.sweep.worker`` reads its job
(JSON on stdin: ``config``, ``out``, ``resume``, ``threads``) and runs ``fedloom.run``.

Exit status as ``fedloom run``'s: 0 finished, 2 bad config or input, 1 anything else; the last
line on stderr is then the error (the sweep records it in results.csv). The process dies with
its parent (Linux ``PR_SET_PDEATHSIG``), so a killed sweep leaves no run going on behind it
that a rerun would collide with.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import fedloom  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits; exit at once if it has."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent exited before prctl took effect
        os._exit(1)


def main() -> int:
    job = json.loads(sys.stdin.read())
    die_with_parent(int(job["parent"]))
    import torch

    from fedloom.api import run
    from fedloom.errors import FedloomInputError

    torch.set_num_threads(int(job["threads"]))
    try:
        if job["resume"]:
            run(None, resume=job["out"], progress=False)
        else:
            run(job["config"], out=job["out"], progress=False)
    except FedloomInputError as err:
        print(f"{type(err).__name__}: {err}".replace("\n", " "), file=sys.stderr, flush=True)
        return 2
    except Exception as err:
        traceback.print_exc()
        print(f"{type(err).__name__}: {err}".splitlines()[0], file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
