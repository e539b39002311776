"""Smoke tests of benchmarks/secagg_cost.py and benchmarks/he_cost.py on tiny rounds (the full
benchmarks are not tests): they run, print their table and a JSON last line, and count the
bytes the protocols' transcripts say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """The benchmark script ``name``, imported as ``benchmarks_<name>`` (registered, as its
    dataclasses need)."""
    qualified = f"benchmarks_{name}"
    spec = importlib.util.spec_from_file_location(qualified, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def last_json_line(capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_secagg_cost_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    n, d = 10, 50
    results = load("secagg_cost").main(
        ["--clients", str(n), "--dim", str(d), "--repeats", "1", "--dropouts", "0,0.2"]
    )
    out, printed = last_json_line(capsys)
    assert printed == results
    assert "| SecAgg+ (k=9, t=6) | 20% |" in out and "| SecAgg (t=6) | 0% |" in out
    assert len(results) == 4
    for name, row in results.items():
        assert row["included"] == (n if name.endswith("dropout=0.0") else n - 2)
        assert all(s >= 0 for s in row["seconds"].values()) and row["seconds"]["total"] > 0
    # without dropout (k = n - 1: SecAgg+ is SecAgg here) a client sends its keys (4 + 64 B),
    # n - 1 encrypted share pairs (4 + 4 + 168 each), y_u (4 + 4 d) and n b-shares (4 + 4 + 66
    # each); it receives n - 1 key pairs (68 each), n - 1 share pairs and n survivor ids
    up = 68 + (4 + (n - 1) * 172) + (4 + 4 * d) + (4 + n * 70)
    down = (n - 1) * 68 + (n - 1) * 172 + 4 * n
    for name in ("SecAgg+ (k=9, t=6) dropout=0.0", "SecAgg (t=6) dropout=0.0"):
        assert results[name]["bytes_up_per_client"] == up
        assert results[name]["bytes_down_per_client"] == down


def test_he_cost_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    clients, d = 2, 10
    args = ["--clients", str(clients), "--dim", str(d), "--budget-s", "0"]
    results = load("he_cost").main([*args, "--schemes", "paillier-1024,ckks"])
    out, printed = last_json_line(capsys)
    assert printed == results
    assert "| paillier-1024 |" in out and "| ckks |" in out
    paillier, ckks = results["costs"]
    for cost in (paillier, ckks):
        assert cost["measured_clients"] == cost["clients"] == clients
        assert cost["ciphertexts_per_client"] == 1  # d fits one ciphertext in both schemes
        assert cost["encrypt_s_per_client"] > 0 and cost["decrypt_s"] > 0
    # Paillier: one 1024-bit ciphertext (256 B) per client, a 128-byte public key, and sums
    # within each client's fixed-point rounding (2^-17 per coordinate)
    assert (paillier["bytes_per_client"], paillier["key_bytes"]) == (256, 128)
    assert paillier["values_per_ciphertext"] >= d
    assert paillier["max_abs_error_sum"] <= clients * 2.0**-17
    assert ckks["values_per_ciphertext"] == 4096
    assert ckks["bytes_per_client"] > 0 and ckks["max_abs_error_sum"] < 1e-6
