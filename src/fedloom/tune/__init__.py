"""Federated hyperparameter search (``fedloom tune``, docs/tune.md): multivariate TPE with
Hyperband or successive-halving pruning over rounds, resumable from a journal file."""

from fedloom.tune.search import TuneResult, tune
from fedloom.tune.space import SearchSpace, load_space, parse_space

__all__ = ["SearchSpace", "TuneResult", "load_space", "parse_space", "tune"]
