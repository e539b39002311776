"""Modules beside the model's head: the pieces FedCP (Zhang et al., KDD 2023, arXiv:2307.01217)
and GPFL (Zhang et al., ICCV 2023, arXiv:2308.10279) share (:mod:`fedloom.algorithms.fedcp`,
:mod:`fedloom.algorithms.gpfl`).

Both split the model at the input h of its head (one ``nn.Linear``, ``FedModel.head_modules``)
into a feature extractor (the body) and a personalized head, and put trainable modules of their
own between the two (FedCP's conditional policy network and global head, GPFL's conditional
valve and global category embeddings). Here that is one model, :class:`HeadBeside`: the
user's model as its submodule ``model``, the extra modules beside it, and a per-client
conditioning buffer ``condition`` (FedCP's v_i, GPFL's p_i). Its forward runs the user's model
and replaces the head's output by ``route(h, head)``, so::

    parameters:  model.<body>...   model.<head>.{weight,bias}   <the extra modules>...
                 (shared)          (personal)                   (shared)
    buffers:     model.<buffers>... (shared)                    condition (personal)

The algorithm builds it once per run (``Algorithm.model_for``, engine/build.py) around the
configured model or the one handed to ``fedloom.run``, so its parameters are the run's like any
other: initialized from the run's init stream (the user's model first, in its own order, so its
initial weights are those of a run without the extra modules), sent, averaged, checkpointed,
stacked by the vmap backend, and evaluated by the engine's evaluation through ``forward``.

The sharing is FedPer's (:mod:`fedloom.algorithms.fedper`): the server averages everything but
the personalized head and the conditioning buffer, which stay on the client. The algorithm
sets ``condition`` before a round's local steps (``local_start``) and in the deployed model
(``deployed_model``) from what it is made of (:meth:`FeatureHeads.condition`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedper import FedPer, InitialHead
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.errors import ConfigError
from fedloom.models.base import FedModel
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import Batch, Carry, Ops

CONDITION = "condition"
"""The buffer of a client's conditioning vector (FedCP's v_i, GPFL's p_i)."""

INNER = "model."
"""Prefix of the user's model's keys inside :class:`HeadBeside`."""


class HeadBeside(FedModel):
    """The user's ``model`` (whose head ``head`` is one ``nn.Linear``) with modules beside its
    head: ``forward(x)`` is the model's forward with the head's output replaced by
    ``route(h, head)`` (h the head's input), a forward hook that works under ``vmap`` and
    ``torch.func.grad`` as ``FunctionalModel.forward_with_features`` does.
    ``forward(x, with_features=True)`` also returns h; ``features_only=True`` returns h alone
    (the head's own output is then left as it is: no route)."""

    def __init__(self, model: nn.Module, head: str) -> None:
        super().__init__()
        self.model = model
        self.head = head
        linear = model.get_submodule(head)
        assert isinstance(linear, nn.Linear)
        self.dim, self.num_classes = linear.in_features, linear.out_features
        self.head_modules = (INNER + head,)  # the personalized head
        self.norm_modules = tuple(INNER + n for n in getattr(model, "norm_modules", ()))
        self.register_buffer(CONDITION, torch.zeros(self.dim))

    def forward(
        self,
        x: torch.Tensor,
        with_features: bool = False,
        features_only: bool = False,
        **route: Any,
    ) -> Any:
        linear = self.model.get_submodule(self.head)
        store: dict[str, torch.Tensor] = {}

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            store["h"] = args[0]
            return None if features_only else self.route(args[0], module, **route)

        handle = linear.register_forward_hook(hook)
        try:
            out = self.model(x)
        finally:
            handle.remove()
        if features_only:
            return store["h"]
        return (out, store["h"]) if with_features else out

    def route(self, h: torch.Tensor, head: nn.Linear, **route: Any) -> torch.Tensor:
        """The output in place of ``head(h)``; ``head``'s tensors are the personalized head's."""
        raise NotImplementedError


def wrap(cls: type[HeadBeside], module: FedModel, algorithm: str, **options: Any) -> HeadBeside:
    """``cls`` around ``module``, whose head must be one ``nn.Linear`` (a ConfigError naming
    ``algorithm`` otherwise); a module that is already wrapped is returned as it is."""
    if isinstance(module, cls):
        return module
    head = single_head(FunctionalModel(module, "classification"), algorithm)
    if not any(not k.startswith(head + ".") for k, _ in module.named_parameters()):
        raise ConfigError(
            f"algorithm.name: {algorithm} splits the model into a feature extractor and its "
            f"head, and {type(module).__name__} has no parameters outside its head {head!r}; "
            "use e.g. model.name: mlp or cnn"
        )
    return cls(module, head, **options)


def call_module(module: nn.Module, name: str, params: Tree, *args: torch.Tensor) -> torch.Tensor:
    """Submodule ``name`` of ``module`` called on ``args`` with its tensors from ``params``
    (keys ``<name>.<tensor>``): a pure function of ``params``, for the objectives."""
    prefix = name + "."
    own = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
    return functional_call(module.get_submodule(name), own, args)


class ConditionedInitialHead(InitialHead):
    """FedPer's new client (the body with the initial head) conditioned on its data."""

    algorithm: FeatureHeads

    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        return self.algorithm.conditioned(*super().new_client_model(server, task), task)


class FeatureHeads(FedPer):
    """FedPer's sharing of a :class:`HeadBeside` model: the server averages the body and the
    extra modules (``weighting``: n_k / n by default), each client keeps its personalized head
    and conditioning buffer. A subclass names its model class (``Model``), says how the
    conditioning vector is made (``condition``) and which client program trains."""

    Model: type[HeadBeside]
    capabilities = FedPer.capabilities.but(
        supports_sample_dp=False,  # an objective of its own, not DP-SGD's per-sample loss
        classification_only="a classifier head beside the model's",
    )
    Deployment = ConditionedInitialHead

    @classmethod
    def model_for(cls, module: FedModel, config: AlgorithmConfig) -> FedModel:
        return wrap(cls.Model, module, cls.name)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        module = ctx.model.module
        assert isinstance(module, self.Model), f"{self.name} runs on its own model (model_for)"
        self.module: HeadBeside = module
        self.head_keys = tuple(k for k in self.split.local_params)  # (weight[, bias])

    def local_keys(self) -> set[str]:
        return super().local_keys() | {CONDITION}

    def condition(self, params: Tree, task: ClientTask) -> torch.Tensor:
        """The conditioning vector of client ``task.client_id`` for the model ``params`` (the
        server's shared part with the client's personalized head)."""
        raise NotImplementedError

    def conditioned(self, params: Tree, buffers: Tree, task: ClientTask) -> tuple[Tree, Tree]:
        """(params, buffers) with the client's conditioning vector for ``params``."""
        return params, {**buffers, CONDITION: self.condition(params, task)}

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """FedPer's start [the message's shared part, own head], conditioned: the vector is
        fixed for the round's local steps."""
        return self.conditioned(*super().local_start(message, state, task), task)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """FedPer's [server's shared part, own head], conditioned on what it deploys."""
        return self.conditioned(*super().deployed_model(server, state, task), task)

    def fresh_client_model(
        self, params: Tree, buffers: Tree, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """FedPer's (the initial head, fine-tuned with ``finetune_steps``) on the model
        conditioned as the client's training would be."""
        return super().fresh_client_model(*self.conditioned(params, buffers, task), task)


class FeatureHeadsProgram(SGDProgram):
    """SGD (or AdamW, ``train.optimizer``) on the algorithm's minibatch ``objective`` over the
    keys that train locally (every parameter but ``frozen``), with the gradient of
    (decay / 2) ||theta||^2 added on the keys ``decayed`` (torch.optim.SGD's weight_decay):
    FedPer's start and finish (the shared part up, the head kept)."""

    private_step = False  # its objective is its own, not DP-SGD's per-sample loss
    takes_optimizer = True

    def __init__(
        self, algorithm: FeatureHeads, frozen: tuple[str, ...] = (), decayed: tuple[str, ...] = ()
    ) -> None:
        super().__init__(algorithm, start=algorithm.local_start, finish=algorithm.local_finish)
        self.algorithm: FeatureHeads = algorithm
        self.module = algorithm.module
        self.frozen = frozen
        self.decayed = decayed

    def decay(self) -> float:
        return 0.0

    def objective(
        self, params: Tree, buffers: Tree, batch: Batch, carry: Carry, shared: dict[str, Any]
    ) -> torch.Tensor:
        raise NotImplementedError

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        params = carry["params"]
        frozen = {k: params[k] for k in self.frozen}
        trained = {k: v for k, v in params.items() if k not in frozen}

        # buffers as an argument: BatchNorm's forward updates them in place
        def loss(p: Tree, b: Tree) -> torch.Tensor:
            return self.objective({**p, **frozen}, b, batch, carry, shared)

        grads, value = ops.value_and_grad(loss, trained, carry["buffers"])
        decay = self.decay()
        if decay > 0:
            grads = {
                k: g + decay * trained[k] if k in self.decayed else g for k, g in grads.items()
            }
        new = self.descend(ops, carry, grads, shared["lr"])
        return self.advance(new, carry), {"loss": value}

    def advance(self, new: Carry, carry: Carry) -> Carry:
        """The carry after the step (a subclass moves its step counter)."""
        return new
