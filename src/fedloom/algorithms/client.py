"""How every executor enters an algorithm's client side: the algorithm's one client program
(``Algorithm.make_program``), made once and checked against the run's settings. The
sequential backend runs it one client at a time (``solvers.sequential.run_client``), the
vectorized one a chunk of clients at a time; both take it from :func:`client_program`."""

from __future__ import annotations

from fedloom.algorithms.base import Algorithm
from fedloom.errors import ConfigError
from fedloom.solvers import ClientProgram
from fedloom.solvers.program import takes_optimizer


def client_program(algorithm: Algorithm) -> ClientProgram:
    """``algorithm``'s client program (solvers/program.py), made once by ``make_program``,
    training on augmented minibatches when the dataset declares augmentation
    (``ctx.make_plan.augment``, data/augment.py)."""
    if algorithm._program is None:
        program = algorithm.make_program()
        program.augment = algorithm.ctx.make_plan.augment
        if algorithm.ctx.optimizer is not None:
            refuse_adamw(algorithm, program)
        algorithm._program = program
    return algorithm._program


def refuse_adamw(algorithm: Algorithm, program: ClientProgram) -> None:
    """A config error naming ``algorithm`` when ``train.optimizer: adamw`` cannot apply to it:
    its capabilities declare its steps SGD-only (``Capabilities.sgd_only``), its program's
    steps are its own (solvers/program.py, ``takes_optimizer``), or its moments should persist
    (``moments: client``) in a client state it does not keep, or its program does not keep
    them (``keeps_moments``)."""
    reason = algorithm.capabilities.sgd_only
    if not reason and not takes_optimizer(program):
        reason = (
            "has local steps of its own (its client program does not take the shared SGD "
            "step that AdamW replaces)"
        )
    if reason:
        raise ConfigError(
            f"train.optimizer: adamw: {algorithm.name} {reason}; use train.optimizer: sgd "
            "or another algorithm (docs/optimizers.md)"
        )
    optimizer = algorithm.ctx.optimizer
    keeps_state = type(algorithm).init_client_state is not Algorithm.init_client_state
    if optimizer is not None and optimizer.persist and not keeps_state:
        raise ConfigError(
            f"train.optimizer.moments: client: {algorithm.name} keeps no client state to hold "
            "AdamW's moments across rounds; use moments: round (docs/optimizers.md)"
        )
    if optimizer is not None and optimizer.persist and not program.keeps_moments:
        raise ConfigError(
            f"train.optimizer.moments: client: {algorithm.name}'s client program starts AdamW's "
            "moments from zero every round; use moments: round (docs/optimizers.md)"
        )
