"""Reference rounds of five personalized algorithms, written the way common FL libraries write
them (the PFL counterpart of ``reference.py``, which ``round_time.py`` compares fedloom against).

Per client: ``copy.deepcopy`` of the global model, fresh ``torch.optim.SGD`` optimizers,
``DataLoader(TensorDataset(x, y), shuffle=True)`` and ``zero_grad / backward / step``; the
persistent per-client objects (personal modules, heads) live in a dict keyed by client id
across rounds; the server averages the uploaded state dicts. The math is fedloom's (the
algorithms' docstrings in ``src/fedloom/algorithms/``), with the same hyperparameters and the
same number of local steps; only the minibatch orders differ. Deliberately plain: no flat
buffers, no vmap, no reuse of objects across clients.

- Ditto (ditto.py, (9)): FedAvg's local SGD on the global model, then as many steps of
  omega <- omega - lr (grad f(omega) + mu (omega - theta^t)) on a second loader.
- pFedMe (pfedme.py, (6)-(7)): per minibatch, K SGD steps at ``inner_lr`` on
  f(theta_k) + lam/2 ||theta_k - omega||^2, then omega <- omega - lr lam (omega - theta_k);
  upload omega (beta = 1: the server averages).
- APFL (apfl.py, fixed alpha): per minibatch, the SGD step of w and the step of v along the
  gradient of the mixed model alpha v + (1 - alpha) w (a scratch module); upload w.
- Per-FedAvg FO (perfedavg.py): temp = w - alpha grad f(w; D), w <- w - beta grad f(temp; D'),
  D' from a second, independent loader.
- FedRep (fedrep.py): ``head_epochs`` over the data on the personal head (body frozen), then
  the round's epochs on the body (head frozen); upload and average the body.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from reference import ClientArrays, average_state_dicts
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

Batch = tuple[torch.Tensor, torch.Tensor]


class PFLReference:
    """One personalized algorithm's reference rounds: the global model, the clients'
    persistent objects (``personal``, by client id) and the server's averaging.

    Subclasses implement ``client`` (one client's local work: its upload and mean loss) and
    set ``weighting`` (the algorithm's default: ``samples`` or ``uniform``)."""

    name = ""
    weighting = "uniform"

    def __init__(
        self,
        global_model: nn.Module,
        lr: float,
        batch_size: int,
        epochs: int = 1,
        device: torch.device | None = None,
    ) -> None:
        self.model = global_model
        self.initial = copy.deepcopy(global_model)
        self.lr = lr
        self.batch_size = batch_size
        self.epochs = epochs
        self.device = device
        self.personal: dict[int, Any] = {}

    # -- the pieces every client uses ------------------------------------------------------
    def loader(self, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> DataLoader:
        return DataLoader(
            TensorDataset(x, y), batch_size=self.batch_size, shuffle=True, generator=generator
        )

    def batches(self, loader: DataLoader, epochs: int) -> Iterator[Batch]:
        """``epochs`` passes over ``loader``, each minibatch moved to the device."""
        for _ in range(epochs):
            for xb, yb in loader:
                if self.device is not None:
                    xb = xb.to(self.device, non_blocking=True)
                    yb = yb.to(self.device, non_blocking=True)
                yield xb, yb

    def steps(self, loader: DataLoader, count: int) -> Iterator[Batch]:
        """``count`` minibatches of ``loader``, starting a new pass whenever one ends."""
        epochs = -(-count // max(1, len(loader)))
        for i, batch in enumerate(self.batches(loader, epochs)):
            if i == count:
                return
            yield batch

    def local_steps(self, loader: DataLoader) -> int:
        return self.epochs * len(loader)

    # -- a round -----------------------------------------------------------------------------
    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        raise NotImplementedError

    def round(self, clients: Sequence[ClientArrays], seed: int = 0) -> float:
        """One round with every client participating (client id = position); updates the
        global model in place (the uploaded keys only) and returns the mean training loss."""
        generator = torch.Generator().manual_seed(seed)
        states, weights, losses = [], [], []
        for k, (x, y) in enumerate(clients):
            state, loss = self.client(k, x, y, generator)
            states.append(state)
            weights.append(float(len(x)) if self.weighting == "samples" else 1.0)
            losses.append(loss)
        self.model.load_state_dict(average_state_dicts(states, weights), strict=False)
        return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)

    def uploaded_keys(self) -> list[str]:
        """The state-dict keys the clients upload and the server averages."""
        return list(self.model.state_dict())


def prox_term(model: nn.Module, anchor: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """mu/2 ||w - anchor||^2 over the model's parameters."""
    return (
        0.5
        * mu
        * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
    )


class DittoReference(PFLReference):
    """Ditto with FedAvg as the global algorithm (sample-weighted average)."""

    name = "ditto"
    weighting = "samples"

    def __init__(self, *args: Any, mu: float = 0.1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mu = mu

    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        model = copy.deepcopy(self.model)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        loader = self.loader(x, y, generator)
        total, steps = 0.0, 0
        for xb, yb in self.batches(loader, self.epochs):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
        # the personal model omega_k (omega_k^(0) = theta^(0)): as many steps of (9)
        personal = self.personal.get(k)
        if personal is None:
            personal = self.personal[k] = copy.deepcopy(self.initial)
        anchor = [p.detach() for p in self.model.parameters()]  # theta^t, the broadcast
        personal_optimizer = torch.optim.SGD(personal.parameters(), lr=self.lr)
        for xb, yb in self.steps(self.loader(x, y, generator), steps):
            personal_optimizer.zero_grad()
            loss = F.cross_entropy(personal(xb), yb) + prox_term(personal, anchor, self.mu)
            loss.backward()
            personal_optimizer.step()
        return model.state_dict(), total / max(1, steps)


class PFedMeReference(PFLReference):
    """pFedMe with the server step beta = 1 (the plain mean of the uploaded omegas)."""

    name = "pfedme"

    def __init__(
        self,
        *args: Any,
        lam: float = 15.0,
        inner_steps: int = 5,
        inner_lr: float = 0.09,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lam, self.inner_steps, self.inner_lr = lam, inner_steps, inner_lr

    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        personal = copy.deepcopy(self.model)  # theta_k <- theta, warm-started per minibatch
        personal.train()
        local = copy.deepcopy(self.model)  # omega <- theta, what the client uploads
        omega = list(local.parameters())
        optimizer = torch.optim.SGD(personal.parameters(), lr=self.inner_lr)
        total, steps = 0.0, 0
        for xb, yb in self.batches(self.loader(x, y, generator), self.epochs):
            anchor = [w.detach() for w in omega]
            for _ in range(self.inner_steps):
                optimizer.zero_grad()
                loss = F.cross_entropy(personal(xb), yb)
                (loss + prox_term(personal, anchor, self.lam)).backward()
                optimizer.step()
                total += loss.item()
                steps += 1
            with torch.no_grad():
                for w, theta in zip(omega, personal.parameters(), strict=True):
                    w.sub_(self.lr * self.lam * (w - theta))
        self.personal[k] = personal
        return local.state_dict(), total / max(1, steps)


class APFLReference(PFLReference):
    """APFL with a fixed mixture weight alpha; the server averages the uploaded w."""

    name = "apfl"

    def __init__(self, *args: Any, alpha: float = 0.25, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alpha = alpha

    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        model = copy.deepcopy(self.model)  # w
        model.train()
        personal = self.personal.get(k)  # v, v^(0) = the initial model
        if personal is None:
            personal = self.personal[k] = copy.deepcopy(self.initial)
        mixed = copy.deepcopy(self.model)  # scratch: alpha v + (1 - alpha) w
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        personal_optimizer = torch.optim.SGD(personal.parameters(), lr=self.lr)
        total, steps = 0.0, 0
        for xb, yb in self.batches(self.loader(x, y, generator), self.epochs):
            with torch.no_grad():  # the mixture of the values before this step
                for m, v, w in zip(
                    mixed.parameters(), personal.parameters(), model.parameters(), strict=True
                ):
                    m.copy_(self.alpha * v + (1.0 - self.alpha) * w)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            mixed.zero_grad()
            F.cross_entropy(mixed(xb), yb).backward()
            personal_optimizer.zero_grad()
            for v, m in zip(personal.parameters(), mixed.parameters(), strict=True):
                v.grad = m.grad.clone()
            personal_optimizer.step()
            total += loss.item()
            steps += 1
        return model.state_dict(), total / max(1, steps)


class PerFedAvgReference(PFLReference):
    """Per-FedAvg, first-order variant (FO), beta = lr."""

    name = "perfedavg"

    def __init__(self, *args: Any, alpha: float = 0.01, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alpha = alpha

    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        model = copy.deepcopy(self.model)
        model.train()
        inner = torch.optim.SGD(model.parameters(), lr=self.alpha)
        outer = torch.optim.SGD(model.parameters(), lr=self.lr)
        loader = self.loader(x, y, generator)
        second = self.steps(self.loader(x, y, generator), self.local_steps(loader))
        total, steps = 0.0, 0
        for (xb, yb), (xb2, yb2) in zip(self.batches(loader, self.epochs), second, strict=True):
            saved = [p.detach().clone() for p in model.parameters()]
            inner.zero_grad()  # temp = w - alpha grad f(w; D)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            inner.step()
            outer.zero_grad()  # grad f(temp; D'), applied at w
            F.cross_entropy(model(xb2), yb2).backward()
            with torch.no_grad():
                for p, w in zip(model.parameters(), saved, strict=True):
                    p.copy_(w)
            outer.step()
            total += loss.item()
            steps += 1
        return model.state_dict(), total / max(1, steps)


class FedRepReference(PFLReference):
    """FedRep: personal heads kept by client id, the body uploaded and averaged."""

    name = "fedrep"

    def __init__(self, *args: Any, head_epochs: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_epochs = head_epochs
        prefixes = tuple(f"{m}." for m in getattr(self.model, "head_modules", ()))
        self.head_keys = [k for k in self.model.state_dict() if k.startswith(prefixes)]
        if not self.head_keys:
            raise ValueError(f"fedrep: {type(self.model).__name__} declares no head_modules")

    def uploaded_keys(self) -> list[str]:
        return [k for k in self.model.state_dict() if k not in self.head_keys]

    def client(
        self, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], float]:
        model = copy.deepcopy(self.model)  # the server's body ...
        model.train()
        head = self.personal.get(k)  # ... with the client's own head
        if head is None:
            initial = self.initial.state_dict()
            head = {key: initial[key].clone() for key in self.head_keys}
        model.load_state_dict(head, strict=False)
        named = dict(model.named_parameters())
        head_params = [p for n, p in named.items() if n in self.head_keys]
        body_params = [p for n, p in named.items() if n not in self.head_keys]
        loader = self.loader(x, y, generator)
        total, steps = 0.0, 0
        for params, frozen, epochs in (
            (head_params, body_params, self.head_epochs),
            (body_params, head_params, self.epochs),
        ):
            for p in frozen:
                p.requires_grad_(False)
            for p in params:
                p.requires_grad_(True)
            optimizer = torch.optim.SGD(params, lr=self.lr)
            for xb, yb in self.batches(loader, epochs):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                total += loss.item()
                steps += 1
        state = model.state_dict()
        self.personal[k] = {key: state[key].detach().clone() for key in self.head_keys}
        return {key: state[key] for key in self.uploaded_keys()}, total / max(1, steps)


REFERENCES: dict[str, type[PFLReference]] = {
    cls.name: cls
    for cls in (DittoReference, PFedMeReference, APFLReference, PerFedAvgReference, FedRepReference)
}


def build_reference(
    algorithm: dict[str, Any],
    global_model: nn.Module,
    lr: float,
    batch_size: int,
    epochs: int = 1,
    device: torch.device | None = None,
) -> PFLReference:
    """The reference of ``algorithm`` (a fedloom algorithm config: ``name`` and the options
    the reference knows, e.g. ``mu``, ``lam``, ``alpha``, ``head_epochs``)."""
    options = {k: v for k, v in algorithm.items() if k != "name"}
    name = algorithm.get("name")
    if name not in REFERENCES:
        raise ValueError(
            f"algorithm.name: {name!r} has no PFL reference; allowed: {', '.join(REFERENCES)}"
        )
    if name == "perfedavg":
        variant = options.pop("variant", "fo")
        if variant != "fo":
            raise ValueError(f"algorithm.variant: {variant!r}: the reference runs only 'fo'")
    return REFERENCES[name](global_model, lr, batch_size, epochs, device, **options)
