"""peft parity and merging (docs/peft.md) on the tiny random BERT: the functional LoRA
equals the peft library's (logits and gradients), the peft state dict round-trips bit-exactly,
and the merged model W0 + s B A equals the adapter model."""

from __future__ import annotations

import copy

import pytest
import torch

import peft  # the reference implementation (a test dependency)
from fedloom.core.functional import FunctionalModel
from fedloom.models.transformer import (
    PeftSpec,
    PeftTransformer,
    merged_logits,
    tiny_bert,
)
from fedloom.peft.build import streams
from fedloom.peft.interop import from_peft_state_dict, lora_config, to_peft_state_dict


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30000, (6, 10), generator=g)
    ids[0, 7:] = 0  # padding: the 4-D mask must ignore it like transformers' 2-D mask
    ids[3, 4:] = 0
    return ids


def _model_and_params(share: str = "a", residual: bool = False):
    bert = tiny_bert(streams(0)("backbone"))
    spec = PeftSpec(
        kind="lora", r=4, alpha=8, targets=("query", "value"), share=share, residual=residual
    )
    model = PeftTransformer(bert, 5, spec, streams(0))
    fm = FunctionalModel(model, "classification")
    params, buffers = fm.initial_state(0)
    g = torch.Generator().manual_seed(1)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in params.items()}
    buffers = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in buffers.items()}
    return bert, model, fm, params, buffers


def _peft_logits(bert, model, params, ids):
    ref = peft.get_peft_model(copy.deepcopy(bert), lora_config(model))
    peft.set_peft_model_state_dict(ref, to_peft_state_dict(model, params))
    ref.eval()
    keep = (ids != 0).long()
    h = ref(input_ids=ids, attention_mask=keep).last_hidden_state
    w = keep.float().unsqueeze(-1)
    pooled = (h * w).sum(1) / w.sum(1)
    return ref, pooled @ params["classifier.weight"].T + params["classifier.bias"]


def test_logits_and_gradients_match_peft():
    bert, model, fm, params, buffers = _model_and_params()
    ids, y = _ids(), torch.tensor([0, 1, 2, 3, 4, 0])
    ref, ref_logits = _peft_logits(bert, model, params, ids)
    ours = fm.forward(params, buffers, ids)
    assert (ours - ref_logits).abs().max() < 1e-5
    grads, _ = fm.grad_and_loss(params, buffers, ids, y)
    torch.nn.functional.cross_entropy(ref_logits, y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    theirs = from_peft_state_dict(
        model, {n.replace(".default", ""): g for n, g in ref_grads.items()}
    )
    assert theirs.keys() == {k for k in grads if k.startswith("lora.")}
    for k, g in theirs.items():
        assert (grads[k] - g).abs().max() < 1e-5, k


def test_peft_state_dict_round_trip_is_bit_exact():
    bert, model, _, params, _ = _model_and_params()
    ref = peft.get_peft_model(copy.deepcopy(bert), lora_config(model))
    peft.set_peft_model_state_dict(ref, to_peft_state_dict(model, params))
    back = from_peft_state_dict(model, peft.get_peft_model_state_dict(ref))
    lora = {k: v for k, v in params.items() if k.startswith("lora.")}
    assert back.keys() == lora.keys()
    assert all(torch.equal(back[k], lora[k]) for k in lora)


@pytest.mark.parametrize("share, residual", [("a", False), ("ffa", False), ("fedex", True)])
def test_merged_model_equals_adapter_model(share, residual):
    _, model, fm, params, buffers = _model_and_params(share, residual)
    ids = _ids(1)
    delta = merged_logits(model, params, buffers, ids) - fm.forward(params, buffers, ids)
    assert delta.abs().max() <= 1e-5


def test_adapters_start_as_the_identity():
    """Houlsby's zero-initialized up-projection: the adapter model at its initial state is the
    frozen backbone (same logits as the plain BertModel with the same head)."""
    bert = tiny_bert(streams(0)("backbone")).eval()  # the reference: no dropout
    model = PeftTransformer(bert, 5, PeftSpec(kind="adapter", bottleneck=4), streams(0))
    fm = FunctionalModel(model, "classification")
    params, buffers = fm.initial_state(0)
    assert any(float(v.abs().sum()) > 0 for k, v in params.items() if "down_weight" in k)
    ids = _ids(2)
    keep = (ids != 0).long()
    with torch.no_grad():
        h = bert(input_ids=ids, attention_mask=keep).last_hidden_state
    w = keep.float().unsqueeze(-1)
    ref = ((h * w).sum(1) / w.sum(1)) @ params["classifier.weight"].T + params["classifier.bias"]
    assert (fm.forward(params, buffers, ids) - ref).abs().max() < 1e-5
