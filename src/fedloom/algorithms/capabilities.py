"""What an algorithm can take part in: one frozen value the config rules
(run_config/rules.py) and the engine read, instead of flags spread over the class
(docs/adding_an_algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Capabilities:
    """An algorithm's traits; the defaults are FedAvg-like except for the server step and
    sample-level DP, which an algorithm declares."""

    communicates: bool = True
    """False for algorithms that send nothing (local-only, centralized): bytes stay 0."""
    pooled: bool = False
    """True for the centralized reference: one virtual client holds all training data."""
    has_global_model: bool = True
    """The server state holds one model every client can deploy (``global_model``)."""
    classification_only: str = ""
    """Why the algorithm needs a classification task (class counts, prototypes ...); empty:
    any task. Checked when the algorithm is built."""
    averages_client_models: bool = False
    """The server step is ``aggregate_models`` of the uploaded models (one ``ctx.aggregate``
    of the clients' parameters): client-level DP (privacy.kind client_dp) can clip each
    client's update and noise the average, asynchrony can fold in stale models."""
    supports_sample_dp: bool = False
    """Sample-level DP-SGD (privacy.kind sample_dp) covers everything the clients compute
    from their data and upload: the client program is an ``SGDProgram`` whose steps take the
    data gradient through ``data_grad`` on the engine's round plan. Checked when the config
    is parsed; that the steps really are private is enforced when they run (docs/privacy.md)."""
    sgd_only: str = ""
    """Why the local steps must be SGD's (the server reads gradients off the SGD trajectory),
    refusing ``train.optimizer: adamw``; empty: AdamW applies wherever the client program
    takes it (docs/optimizers.md)."""

    def but(self, **changes: bool | str) -> Capabilities:
        """These capabilities with ``changes`` (an heir's differences from its parent's)."""
        return replace(self, **changes)  # type: ignore[arg-type]
