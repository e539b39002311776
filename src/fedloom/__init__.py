"""fedloom: federated and personalized federated learning, one algorithm on every executor."""

from fedloom import data
from fedloom.api import run
from fedloom.config import RunConfig
from fedloom.engine.loop import RunResult

__version__ = "0.1.0"

__all__ = ["RunConfig", "RunResult", "__version__", "data", "run"]
