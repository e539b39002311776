"""The ``peft`` library's format: fedloom's LoRA parameters as the state dict that
``peft.get_peft_model_state_dict`` returns for ``get_peft_model(BertModel, LoraConfig(...))``
(keys ``base_model.model.encoder.layer.{i}.attention.self.query.lora_A.weight``), and back,
for ``set_peft_model_state_dict``. The head is not part of a BertModel's PEFT state: it stays
under ``classifier.*`` (``modules_to_save`` in peft's terms)."""

from __future__ import annotations

import torch

from fedloom.core.pytree import Tree
from fedloom.models.transformer import LORA_TARGETS, PeftTransformer

PREFIX = "base_model.model."


def peft_key(key: str) -> str | None:
    """``lora.{i}.{t}.lora_A`` -> peft's key; None for other keys."""
    parts = key.split(".")
    if len(parts) != 4 or parts[0] != "lora" or parts[3] not in ("lora_A", "lora_B"):
        return None
    return f"{PREFIX}encoder.layer.{parts[1]}.{LORA_TARGETS[parts[2]]}.{parts[3]}.weight"


def lora_config(model: PeftTransformer, **kwargs: object) -> object:
    """The ``peft.LoraConfig`` matching the model (r, alpha, target layers, no dropout)."""
    from peft import LoraConfig

    spec = model.spec
    names = sorted({LORA_TARGETS[t] for t in spec.targets})
    return LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=names, **kwargs
    )


def to_peft_state_dict(model: PeftTransformer, params: Tree) -> dict[str, torch.Tensor]:
    """A client's LoRA factors as peft's state dict (FFA's fixed A taken from the model)."""
    out: dict[str, torch.Tensor] = {}
    for i, per_layer in enumerate(model.lora):
        for t in per_layer:
            path = f"encoder.layer.{i}.{LORA_TARGETS[t]}"
            for f in ("lora_A", "lora_B"):
                key = f"lora.{i}.{t}.{f}"
                value = (
                    params[key]
                    if key in params
                    else getattr(model.frozen.bert.get_submodule(path), f)
                )
                out[f"{PREFIX}{path}.{f}.weight"] = value.detach().clone()
    return out


def from_peft_state_dict(model: PeftTransformer, state: dict[str, torch.Tensor]) -> Tree:
    """fedloom's LoRA parameters from peft's state dict (the keys the model trains)."""
    out: Tree = {}
    for key in model.peft_keys():
        theirs = peft_key(key)
        if theirs is not None:
            out[key] = state[theirs].detach().clone()
    return out
