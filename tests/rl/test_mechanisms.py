"""Federated RL's server step through the mechanism protocol (docs/rl.md, Mechanisms):
client-level DP on the policy update and upload compression, each equal to the step composed
by hand, in runs that resume bit for bit; the combinations that do not compose are refused."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.compression.uploads import UploadCompression
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.privacy.client_dp import clip_update, update_norm
from fedloom.rl.config import parse_rl_config
from tests.conftest import metrics_without_time
from tests.resume import Crash, crash_after
from tests.rl.test_sampling import _cfg, aggregator

DP = {"kind": "client_dp", "noise_multiplier": 0.7, "clip": 0.5, "sampling": "fixed"}
STACKED = {"pi.w": torch.tensor([[0.1, 0.2], [2.0, -1.0], [0.3, 0.0], [-0.2, 0.4]])}
PREVIOUS = {"pi.w": torch.tensor([0.0, 0.1])}


def test_client_dp_on_the_policy_update_equals_dp_fedavg_by_hand():
    """theta + (sum_k clip(theta_k - theta) + N(0, (z C)^2)) / m over the sampled agents."""
    agg = aggregator("mean", 3, [2.0] * 4, per_round=3, privacy=DP)
    agents = [0, 1, 3]
    out, sent = agg(STACKED, ["pi.w"], PREVIOUS, 4, agents)
    anchor = PREVIOUS["pi.w"].double()
    total = torch.zeros(2, dtype=torch.float64)
    for k in agents:
        tree = {"pi.w": STACKED["pi.w"][k]}
        clipped = clip_update(tree, PREVIOUS, 0.5, update_norm(tree, PREVIOUS))
        total += clipped["pi.w"].double() - anchor
    noise = 0.35 * torch.randn(2, generator=generator(3, "dp/noise", 4), dtype=torch.float64)
    expected = anchor + (total + noise) / 3
    assert torch.allclose(out["pi.w"].double(), expected, atol=1e-6)
    assert sent == 3 * 2 * 4
    assert agg.privacy_spent()["epsilon"] > 0


def test_compressed_uploads_are_what_the_server_averages():
    agg = aggregator("mean", 3, [1.0, 1.0, 2.0, 1.0], compression={"kind": "int8"})
    out, sent = agg(STACKED, ["pi.w"], PREVIOUS, 2)
    cfg = parse_rl_config({**_cfg(None, "mean"), "seed": 3, "compression": {"kind": "int8"}})
    codec = UploadCompression(cfg.compression, cfg.seed)
    codec.start_round(2, {"params": PREVIOUS})
    decoded, size = [], 0
    for k in range(4):
        upload, n = codec.transmit({"params": {"pi.w": STACKED["pi.w"][k]}}, k, 2)
        decoded.append(upload["params"]["pi.w"])
        size += n
    expected = (decoded[0] + decoded[1] + 2 * decoded[2] + decoded[3]) / 5
    assert torch.allclose(out["pi.w"], expected, atol=1e-6)
    assert sent == size < 4 * 2 * 4


@pytest.mark.parametrize(
    "sections",
    [{"privacy": DP}, {"compression": {"kind": "topk", "ratio": 0.1}}],
    ids=["client_dp", "topk"],
)
def test_a_run_with_a_mechanism_reports_it_and_resumes_bit_for_bit(tmp_path, sections):
    config = {
        **_cfg(2, "mean"),
        **sections,
        "train": {"rounds": 4, "local_steps": 1, "clients_per_round": 3},
        "eval": {"every": 2, "episodes": 2},
        "checkpoint": {"every": 1},
    }
    whole = fedloom.run(config, out=tmp_path / "whole")
    with pytest.raises(Crash), crash_after(3):
        fedloom.run(config, out=tmp_path / "cut")
    resumed = fedloom.run(resume=tmp_path / "cut")
    assert metrics_without_time(resumed.history) == metrics_without_time(whole.history)
    for key in whole.global_params:
        assert torch.equal(whole.global_params[key], resumed.global_params[key])
    name = next(iter(sections))
    assert whole.summary[name] == resumed.summary[name]
    if name == "privacy":
        assert whole.history[-1]["privacy"]["epsilon"] == whole.summary["privacy"]["epsilon"]
    else:
        assert whole.summary["compression"]["compression_factor"] > 2


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"privacy": {**DP, "kind": "sample_dp"}}, "not DP-SGD"),
        ({"privacy": {**DP, "sampling": "poisson"}}, "sampling: fixed"),
        ({"privacy": DP, "aggregator": {"kind": "median"}}, "does not combine"),
        ({"privacy": DP, "compression": {"kind": "int8"}}, "does not combine"),
        ({"compression": {"download": "int8"}}, "broadcast is not compressed"),
        ({"algorithm": {"name": "local"}, "privacy": DP}, "does not aggregate"),
    ],
)
def test_mechanisms_that_do_not_compose_are_refused(sections, message):
    with pytest.raises(ConfigError, match=message):
        parse_rl_config({**_cfg(3, "mean"), **sections})
