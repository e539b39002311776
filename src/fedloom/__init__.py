"""fedloom: federated and personalized federated learning, one algorithm on every executor."""

# First, before anything imports torch: OpenMP reads its wait policy when torch loads it.
from fedloom.engine.threads import default_openmp_wait

default_openmp_wait()

from fedloom import audit, data  # noqa: E402  (audit: a callable package, fedloom.audit(...))
from fedloom.api import run  # noqa: E402
from fedloom.config import RunConfig  # noqa: E402
from fedloom.engine.shell import RunResult  # noqa: E402

__version__ = "0.1.0"

__all__ = ["RunConfig", "RunResult", "__version__", "audit", "data", "run"]
