"""Train-time augmentation (data/augment.py): the crop and flip against hand-computed pixels,
the draws' stream and alignment with the plan, and the batched gather of solvers/local.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedloom.core.rng import generator
from fedloom.data.augment import Augmenter, AugmentSpec, augment_batch
from fedloom.errors import DataError
from fedloom.solvers.local import PlanMaker, batch_plan, minibatches

IMAGE = torch.arange(1.0, 17.0).view(1, 1, 4, 4)
"""[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]"""


def test_crop_of_the_padded_image_by_hand():
    # padding 1: the 6x6 padded image; offset (0, 0) is the window one pixel up and left
    out = augment_batch(IMAGE, torch.tensor([[0, 0, 0]]), 1)
    assert out[0, 0].tolist() == [[0, 0, 0, 0], [0, 1, 2, 3], [0, 5, 6, 7], [0, 9, 10, 11]]
    # offset (2, 1): one pixel down, centred horizontally
    out = augment_batch(IMAGE, torch.tensor([[2, 1, 0]]), 1)
    assert out[0, 0].tolist() == [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [0, 0, 0, 0]]
    # offset (p, p) is the image itself
    assert torch.equal(augment_batch(IMAGE, torch.tensor([[1, 1, 0]]), 1), IMAGE)


def test_flip_by_hand_and_flip_after_crop():
    out = augment_batch(IMAGE, torch.tensor([[0, 0, 1]]), 0)
    assert out[0, 0].tolist() == [[4, 3, 2, 1], [8, 7, 6, 5], [12, 11, 10, 9], [16, 15, 14, 13]]
    # crop at (1, 2) of the padding-1 image, then mirrored (torchvision's order)
    out = augment_batch(IMAGE, torch.tensor([[1, 2, 1]]), 1)
    assert out[0, 0].tolist() == [[0, 4, 3, 2], [0, 8, 7, 6], [0, 12, 11, 10], [0, 16, 15, 14]]


def test_every_offset_and_channel_matches_pad_slice_flip():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(50, 3, 5, 6, generator=g)
    p = 2
    params = torch.stack(
        [
            torch.randint(0, 2 * p + 1, (50,), generator=g),
            torch.randint(0, 2 * p + 1, (50,), generator=g),
            torch.randint(0, 2, (50,), generator=g),
        ],
        1,
    )
    out = augment_batch(x, params, p)
    padded = F.pad(x, (p, p, p, p))
    for n, (dy, dx, flip) in enumerate(params.tolist()):
        want = padded[n, :, dy : dy + 5, dx : dx + 6]
        want = want.flip(-1) if flip else want
        assert torch.equal(out[n], want), n
    assert out.shape == x.shape and torch.equal(x, x.clone())  # input untouched


def test_draws_come_from_the_clients_augment_stream_aligned_with_the_plan():
    aug = Augmenter(AugmentSpec(crop_padding=4, flip=True), seed=7)
    plan = batch_plan(30, 8, 5, generator(7, "batches", 2, 3))
    drawn = aug.draw(plan, "batches", 2, 3)
    total = sum(b.shape[0] for b in plan)
    assert drawn.params.shape == (total, 3)
    # one code per entry, uniform over the 9 x 9 x 2 (dy, dx, flip)
    code = torch.randint(0, 162, (total,), generator=generator(7, "augment", 2, 3))
    want = torch.stack([code // 18, (code // 2) % 9, code % 2], 1)
    assert torch.equal(drawn.params, want)
    assert drawn.starts == (0, 8, 16, 24, 30)  # 30 samples: 8, 8, 8, 6, then a new epoch's 8
    # only (seed, round, client, purpose) and the plan matter
    assert torch.equal(aug.draw(plan, "batches", 2, 3).params, drawn.params)
    assert not torch.equal(aug.draw(plan, "batches", 2, 4).params, drawn.params)
    assert not torch.equal(aug.draw(plan, "batches", 3, 3).params, drawn.params)
    assert not torch.equal(aug.draw(plan, "finetune", 2, 3).params, drawn.params)
    # a straggler's plan is a prefix of the full one: so are its draws
    assert torch.equal(aug.draw(plan[:2], "batches", 2, 3).params, drawn.params[:16])
    long = batch_plan(3000, 100, 40, generator(7, "batches", 2, 3))
    assert torch.equal(
        aug.draw(long[:7], "batches", 2, 3).params, aug.draw(long, "batches", 2, 3).params[:700]
    )


def test_draws_range_and_flip_rate():
    params = Augmenter(AugmentSpec(), 0).draw([torch.arange(20000)], "batches", 0, 0).params
    assert params[:, :2].min() == 0 and params[:, :2].max() == 8
    assert abs(params[:, 2].float().mean().item() - 0.5) < 0.02
    for col in (0, 1):
        rates = torch.bincount(params[:, col], minlength=9).float() / 20000
        assert torch.allclose(rates, torch.full((9,), 1 / 9), atol=0.012), col
    # independent: dy and dx jointly uniform over the 81 pairs
    joint = torch.bincount(params[:, 0] * 9 + params[:, 1], minlength=81).float() / 20000
    assert joint.max() < 2 / 81 and joint.min() > 0.4 / 81
    crop_only = Augmenter(AugmentSpec(flip=False), 0).draw([torch.arange(50)], "batches", 0, 0)
    assert not crop_only.params[:, 2].any()
    flip_only = Augmenter(AugmentSpec(crop_padding=0), 0).draw([torch.arange(50)], "batches", 0, 0)
    assert not flip_only.params[:, :2].any() and flip_only.params[:, 2].any()


def test_minibatches_augment_each_step_with_its_own_draws():
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(20, 3, 6, 6, generator=g), torch.arange(20)
    plan = batch_plan(20, 6, 7, generator(0, "batches", 0, 0))
    drawn = Augmenter(AugmentSpec(crop_padding=2), 0).draw(plan, "batches", 0, 0)
    got = list(minibatches(x, y, plan, drawn))  # steps gathered together, augmented at once
    for s, (idx, (xb, yb)) in enumerate(zip(plan, got, strict=True)):
        assert torch.equal(yb, y[idx])
        rows = drawn.params[drawn.starts[s] : drawn.starts[s] + idx.shape[0]]
        assert torch.equal(xb, augment_batch(x[idx], rows, 2))
    plain = list(minibatches(x, y, plan))
    assert not torch.equal(got[0][0], plain[0][0])


def test_plan_maker_draws_poisson_plans_too():
    maker = PlanMaker(0, 4, poisson=True, augment=Augmenter(AugmentSpec(), 0))
    from fedloom.core.protocol import ClientData

    data = ClientData(torch.rand(12, 1, 4, 4), torch.zeros(12), torch.empty(0), torch.empty(0))
    plan = maker(data, 6, "batches", 1, 2)
    drawn = maker.augmentation(plan, "batches", 1, 2)
    assert drawn is not None and drawn.params.shape[0] == sum(b.shape[0] for b in plan)
    assert PlanMaker(0, 4).augmentation(plan, "batches", 1, 2) is None


def test_non_image_data_is_refused():
    with pytest.raises(DataError, match=r"data\.augment"):
        Augmenter.of(AugmentSpec(), 0, (10,))
    assert Augmenter.of(AugmentSpec(crop_padding=0, flip=False), 0, (3, 8, 8)) is None
    assert Augmenter.of(None, 0, (3, 8, 8)) is None
