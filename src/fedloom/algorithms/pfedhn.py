"""pFedHN, personalized federated hypernetworks (Shamsian, Navon, Fetaya, Chechik, "Personalized
Federated Learning using Hypernetworks", ICML 2021, arXiv:2103.04628, Algorithm 1):
phi_k = H(e_k; Theta_h), trained by the chain rule through the clients' updates.

The server holds a hypernetwork H(.; Theta_h) and one learned embedding e_k per training
client; client k's model is generated, theta_k = H(e_k; Theta_h). H is the authors' ``CNNHyper``
for any target model: an MLP ``Linear(embedding_dim, hidden)`` followed by ``hidden_layers`` x
``(ReLU, Linear(hidden, hidden))``, then one linear head per target parameter tensor, reshaped.
One round (sampled clients S)::

    server: theta_k = H(e_k; Theta_h)  for every k            # server_message (generated table)
    client k in S: theta~_k = local SGD from theta_k          # the shared local solver
                   upload delta_k = theta~_k - theta_k
    server: g = sum_{k in S} c (grad_{Theta_h, e} theta_k)^T (theta_k - theta~_k)   # one vjp
            g <- g min(1, clip / ||g||)                        # clip_grad_norm_ (authors: 50)
            SGD with momentum and weight decay on (Theta_h, e) # torch.optim.SGD, two groups:
                                                               # hn_lr on Theta_h, embedding_lr
                                                               # on the embeddings

with c = 1 (``reduction: sum``: each client's term is one step of Algorithm 1, so a round of one
client is exactly the paper's step) or 1/|S| (``mean``). The gradient is the vector-Jacobian
product of H at e_k with cotangent theta_k - theta~_k = -delta_k: the paper's
grad_Theta = (grad_Theta theta_k)^T Delta theta_k, descended. Defaults are those of the authors'
code (AvivSham/pFedHN, experiments/pfedhn/trainer.py): SGD lr 1e-2, momentum 0.9, weight decay
1e-3 on all of H and the embeddings, embedding lr = lr, gradient norm clipped at 50, hidden 100,
3 hidden blocks, embedding dimension int(1 + K/4) for K training clients. Initialization as
``nn.Embedding`` (N(0, 1)) and ``nn.Linear`` (U(+-1/sqrt(fan_in))), from the stream
(seed, 'pfedhn/init'); the engine's initial target model is not used (H generates it). The
authors ran 5000 one-client steps; in short runs a shallower, less damped H learns faster
(Fashion-MNIST shards, 10 of 20 clients for 20 rounds: 0.77 with the defaults, 0.95 with
``hidden_layers: 1, momentum: 0.5, hn_lr: 0.05``; the defaults reach 0.96 in 60 rounds).

What travels: the server generates the (K, d) table of all theta_k in ``server_message`` (the
engine's message does not know which clients are sampled) and client k reads its row;
``download_bytes`` charges each client one model, theta_k, as a real deployment sends. The
upload is delta_k (one model). H itself never leaves the server.

Buffers: the target model must have none (BatchNorm statistics are not generated and pFedHN
keeps no client state): such models are refused with a ConfigError.

Deployed model: theta_k = H(e_k) for a training client (there is no global model). A new client
(cold start, the paper's generalization to novel clients) fits its own embedding with H frozen:
e starts at the mean of the trained embeddings and takes ``new_client_embedding_steps`` Adam
steps (lr ``new_client_embedding_lr``) on its training loss of H(e), minibatches from the stream
(seed, round, client, 'pfedhn/embedding'); it deploys H(e_new), and the cold-start evaluation
fine-tunes all of its parameters from there (the default hooks).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution, minibatches


class PFedHNConfig(AlgorithmConfig):
    hn_lr: float = Field(default=1e-2, gt=0.0, description="SGD step on the hypernetwork")
    embedding_lr: float | None = Field(
        default=None, gt=0.0, description="SGD step on the client embeddings (default hn_lr)"
    )
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0, description="server SGD momentum")
    weight_decay: float = Field(
        default=1e-3, ge=0.0, description="server SGD weight decay (hypernetwork + embeddings)"
    )
    grad_clip: float | None = Field(
        default=50.0, gt=0.0, description="max norm of the server gradient (None: no clipping)"
    )
    embedding_dim: int | None = Field(
        default=None, ge=1, description="client embedding size (default int(1 + K/4))"
    )
    hidden: int = Field(default=100, ge=1, description="hidden units of the hypernetwork MLP")
    hidden_layers: int = Field(
        default=3, ge=0, description="(ReLU, Linear(hidden, hidden)) blocks after the first layer"
    )
    reduction: Literal["sum", "mean"] = Field(
        default="sum", description="server gradient over the round's clients: sum or mean"
    )
    new_client_embedding_steps: int = Field(
        default=50, ge=0, description="Adam steps fitting a new client's embedding (H frozen)"
    )
    new_client_embedding_lr: float = Field(
        default=0.05, gt=0.0, description="Adam step size of the new-client embedding fit"
    )


def generate(hnet: Tree, embeddings: torch.Tensor, layers: int, shapes: dict[str, Any]) -> Tree:
    """H(e): the target parameters, shape (rows, *shape) each, for each row of ``embeddings``
    (rows, embedding_dim). Pure, so autograd and vjp run through it."""
    h = embeddings
    for i in range(layers + 1):
        if i:
            h = F.relu(h)
        h = F.linear(h, hnet[f"mlp.{i}.weight"], hnet[f"mlp.{i}.bias"])
    rows = embeddings.shape[0]
    return {
        k: F.linear(h, hnet[f"head.{k}.weight"], hnet[f"head.{k}.bias"]).reshape(rows, *shape)
        for k, shape in shapes.items()
    }


class PFedHN(Algorithm):
    name = "pfedhn"
    summary = "pFedHN: a server hypernetwork generates each client's model from its embedding"
    Config = PFedHNConfig
    capabilities = Capabilities(has_global_model=False)
    wire = Wire(rows={"models": 1})

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        module = ctx.model.module
        if ctx.model.buffer_keys:
            raise ConfigError(
                f"algorithm.name: {self.name} generates only the target model's parameters and "
                f"keeps no per-client buffers, and {type(module).__name__} has buffers "
                f"{ctx.model.buffer_keys[:3]} (BatchNorm statistics); use a model without "
                "normalization buffers, e.g. model.name: mlp or cnn"
            )
        self.m = len(ctx.population) if ctx.population else ctx.num_clients
        assert sorted(ctx.population or range(self.m)) == list(range(self.m)), (
            "pfedhn indexes the training clients 0 .. K-1"
        )
        self.shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
        cfg = self.config
        self.embedding_dim = cfg.embedding_dim or int(1 + self.m / 4)

    # -- the hypernetwork -----------------------------------------------------------------
    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of every Linear of H, in initialization order."""
        cfg = self.config
        shapes = {"mlp.0": (cfg.hidden, self.embedding_dim)}
        for i in range(1, cfg.hidden_layers + 1):
            shapes[f"mlp.{i}"] = (cfg.hidden, cfg.hidden)
        for k, shape in self.shapes.items():
            shapes[f"head.{k}"] = (int(torch.Size(shape).numel()), cfg.hidden)
        return shapes

    def generate(self, hnet: Tree, embeddings: torch.Tensor) -> Tree:
        return generate(hnet, embeddings, self.config.hidden_layers, self.shapes)

    def generate_one(self, server: State, embedding: torch.Tensor) -> Tree:
        with torch.no_grad():
            params = self.generate(server["hnet"], embedding.unsqueeze(0))
        return {k: v[0] for k, v in params.items()}

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """H and the embeddings, initialized as nn.Linear and nn.Embedding (the engine's
        initial target ``params`` are not used: H generates the target models)."""
        gen = generator(self.ctx.seed, "pfedhn/init")
        embeddings = torch.randn(self.m, self.embedding_dim, generator=gen)
        hnet: Tree = {}
        for name, (out, fan_in) in self.layer_shapes().items():
            bound = fan_in**-0.5
            hnet[f"{name}.weight"] = (torch.rand(out, fan_in, generator=gen) * 2 - 1) * bound
            hnet[f"{name}.bias"] = (torch.rand(out, generator=gen) * 2 - 1) * bound
        return {
            "hnet": hnet,
            "embeddings": embeddings,
            "momentum": {
                "hnet": {k: torch.zeros_like(v) for k, v in hnet.items()},
                "embeddings": torch.zeros_like(embeddings),
            },
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        """theta_k = H(e_k) for every training client: a (K, *shape) table per tensor."""
        with torch.no_grad():
            return {"models": self.generate(server["hnet"], server["embeddings"])}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        """One SGD step on (Theta_h, e) along sum_k c J_k^T (theta_k - theta~_k) (see the
        module docstring), as torch.optim.SGD would take it after clip_grad_norm_."""
        cfg = self.config
        ids = torch.tensor([r.client_id for r in results])
        coeff = 1.0 if cfg.reduction == "sum" else 1.0 / len(results)
        hnet = {k: v.detach().requires_grad_(True) for k, v in server["hnet"].items()}
        embeddings = server["embeddings"].detach().requires_grad_(True)
        with torch.enable_grad():
            theta = self.generate(hnet, embeddings[ids])
            # <theta_k, -delta_k> summed over clients and tensors: its gradient is the vjp
            objective = sum(
                (theta[k] * torch.stack([r.upload["delta"][k] for r in results])).sum()
                for k in theta
            )
            grads = torch.autograd.grad(-coeff * objective, [*hnet.values(), embeddings])
        grads = list(grads)
        if cfg.grad_clip is not None:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            factor = (cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            grads = [g * factor for g in grads]
        momentum = server["momentum"]
        keys = list(hnet)
        new_hnet, new_mom = {}, {}
        for k, g in zip(keys, grads[:-1], strict=True):
            new_hnet[k], new_mom[k] = self.sgd_step(
                server["hnet"][k], g, momentum["hnet"][k], cfg.hn_lr
            )
        new_emb, emb_mom = self.sgd_step(
            server["embeddings"], grads[-1], momentum["embeddings"], cfg.embedding_lr or cfg.hn_lr
        )
        return {
            "hnet": new_hnet,
            "embeddings": new_emb,
            "momentum": {"hnet": new_mom, "embeddings": emb_mom},
        }

    def sgd_step(
        self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.optim.SGD (no dampening, no Nesterov): g += wd p; buf = mu buf + g (a zero
        buffer makes the first step buf = g, as torch's); p -= lr buf."""
        cfg = self.config
        g = g.detach() + cfg.weight_decay * p
        buf = cfg.momentum * buf + g
        return p - lr * buf, buf

    def summary_extras(self, server: State) -> dict[str, Any]:
        return {
            "hypernetwork_parameters": sum(v.numel() for v in server["hnet"].values()),
            "embedding_dim": self.embedding_dim,
        }

    # -- client ---------------------------------------------------------------------------
    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, start=self.local_start, finish=self.local_finish)

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """theta_k: row ``client_id`` of the generated table (no buffers)."""
        return {k: v[task.client_id] for k, v in message["models"].items()}, {}

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        delta = {k: solved.params[k] - solved.start[k] for k in solved.params}
        return ClientResult(
            {"delta": delta},
            float(task.data.num_train),
            solved.loss,
        )

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """H(e_k) for a training client; a new client's fitted H(e_new)."""
        if task.client_id >= self.m:
            return self.fitted_model(server, task)
        return self.generate_one(server, server["embeddings"][task.client_id]), {}

    def fitted_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        """H(e_new), e_new fitted on the client's training data with H frozen."""
        return self.generate_one(server, self.fit_embedding(server, task)), {}

    def fit_embedding(self, server: State, task: ClientTask) -> torch.Tensor:
        """``new_client_embedding_steps`` Adam steps on the training loss of H(e), from the
        mean of the trained embeddings."""
        cfg, model, data = self.config, self.ctx.model, task.data
        embedding = server["embeddings"].mean(dim=0).clone().requires_grad_(True)
        steps = cfg.new_client_embedding_steps
        if steps == 0 or data.num_train == 0:
            return embedding.detach()
        plan = self.ctx.make_plan(data, steps, "pfedhn/embedding", task.round, task.client_id)
        hnet = {k: v.detach() for k, v in server["hnet"].items()}
        optimizer = torch.optim.Adam([embedding], lr=cfg.new_client_embedding_lr)
        augment = self.ctx.make_plan.augmentation(
            plan, "pfedhn/embedding", task.round, task.client_id
        )
        with model.random_stream(self.ctx.seed, task.round, task.client_id), torch.enable_grad():
            model.module.train()
            for x, y in minibatches(data.x_train, data.y_train, plan, augment):
                params = self.generate(hnet, embedding.unsqueeze(0))
                loss = model.loss({k: v[0] for k, v in params.items()}, {}, x, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return embedding.detach()
