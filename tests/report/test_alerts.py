"""The alert rules (report/alerts.py) fire at the round their conditions (docs/monitoring.md,
"Alerts") first hold, and the report shows them."""

from __future__ import annotations

import copy
from pathlib import Path

from fedloom.report.alerts import evaluate_alerts
from fedloom.report.html import write_report
from fedloom.report.rundir import load_run
from tests.report.fake_run import COLD_START, CONFIG, make_rows, make_run_dir


def alerts_of(tmp_path: Path, rows, config=None, summary=True) -> dict[str, list]:
    run = load_run(make_run_dir(tmp_path / "run", rows, config=config, summary=summary))
    fired: dict[str, list] = {}
    for alert in evaluate_alerts(run):
        fired.setdefault(alert.rule, []).append(alert.round)
    return fired


def with_alerts(**alerts) -> dict:
    config = copy.deepcopy(CONFIG)
    config["monitor"] = {"alerts": alerts}
    return config


def test_a_healthy_run_fires_nothing(tmp_path):
    assert alerts_of(tmp_path, make_rows()) == {}


def test_loss_plateau_after_patience_evaluations(tmp_path):
    rows = make_rows(12)
    for i, row in enumerate(rows[4:], start=4):  # the loss stops improving after round 20
        row["global"]["loss"] = rows[3]["global"]["loss"] + 0.01 * (i % 2)
    fired = alerts_of(tmp_path, rows)
    assert fired["loss_plateau"] == [45.0]  # 5 evaluations (25..45) without a new minimum
    assert alerts_of(tmp_path / "b", rows, config=with_alerts(loss_patience=8))["loss_plateau"] == [
        60.0
    ]


def test_exploding_and_vanishing_update_norms(tmp_path):
    rows = make_rows(6)
    rows[3]["monitor"]["update_norm"]["p50"] = 11 * rows[0]["monitor"]["update_norm"]["p50"]
    assert alerts_of(tmp_path, rows)["update_norm_exploding"] == [20.0]
    rows = make_rows(6)
    rows[4]["monitor"]["update_norm"]["p50"] = float("nan")
    assert alerts_of(tmp_path / "nan", rows)["update_norm_exploding"] == [25.0]
    rows = make_rows(6)
    rows[2]["monitor"]["update_norm"]["p50"] = 1e-4 * rows[0]["monitor"]["update_norm"]["p50"]
    assert alerts_of(tmp_path / "small", rows)["update_norm_vanishing"] == [15.0]


def test_p10_below_threshold_at_the_latest_evaluation(tmp_path):
    rows = make_rows(4)
    rows[-1]["personalized"]["accuracy_p10"] = 0.5
    assert alerts_of(tmp_path, rows)["p10_low"] == [20.0]
    assert "p10_low" not in alerts_of(tmp_path / "off", rows, config=with_alerts(p10_min=None))


def test_zeta_jump_over_200_percent(tmp_path):
    rows = make_rows(5)
    rows[3]["monitor"]["zeta2"] = 3.1 * rows[2]["monitor"]["zeta2"]
    fired = alerts_of(tmp_path, rows)
    assert fired["zeta_jump"] == [20.0]
    rows[3]["monitor"]["zeta2"] = 2.9 * rows[2]["monitor"]["zeta2"]
    assert "zeta_jump" not in alerts_of(tmp_path / "b", rows)


def test_communication_over_budget(tmp_path):
    rows = make_rows(10)  # 7.1 MB per round in each direction: 71 MB by round 5, 142 by 10
    fired = alerts_of(tmp_path, rows, config=with_alerts(communication_budget_mb=100))
    assert fired["communication_budget"] == [10.0]
    assert "communication_budget" not in alerts_of(tmp_path / "b", rows)  # no budget set


def test_slow_cold_start(tmp_path):
    rows = make_rows(4, new_clients=True)  # COLD_START reaches 0.83 after 20 steps
    assert "cold_start_slow" not in alerts_of(tmp_path, rows)  # trained mean ~0.9: 0.9 x = 0.81
    fired = alerts_of(tmp_path / "b", rows, config=with_alerts(cold_start_steps=5))
    assert fired["cold_start_slow"] == [20.0]
    assert COLD_START["accuracy_mean"][2] < 0.81


def test_privacy_budget(tmp_path):
    rows = make_rows(4)
    for i, row in enumerate(rows):
        row["privacy"] = {"epsilon": 4.0 * (i + 1)}
    assert alerts_of(tmp_path, rows)["privacy_budget"] == [15.0]


def test_report_lists_the_alerts_with_their_round(tmp_path):
    rows = make_rows(4)
    rows[-1]["personalized"]["accuracy_p10"] = 0.5
    html = write_report(make_run_dir(tmp_path / "run", rows)).read_text()
    assert 'id="alerts"' in html and "p10_low" in html and "round 20" in html
    healthy = write_report(make_run_dir(tmp_path / "ok", make_rows(4))).read_text()
    assert "No alert rule fired." in healthy


def test_privacy_panel_only_when_a_mechanism_reports_epsilon(tmp_path):
    rows = make_rows(3)
    plain = write_report(make_run_dir(tmp_path / "plain", rows)).read_text()
    assert 'id="privacy"' not in plain
    for i, row in enumerate(rows):
        row["privacy"] = {"epsilon": 1.0 + i, "delta": 1e-5}
    html = write_report(make_run_dir(tmp_path / "dp", rows)).read_text()
    assert 'id="fig-privacy"' in html


def test_secure_aggregation_panel_and_aborted_rounds_alert(tmp_path):
    rows = make_rows(4)
    assert "secure_aggregation_aborted" not in alerts_of(tmp_path / "plain", rows)
    for i, row in enumerate(rows):
        row["secure_aggregation"] = {
            "kind": "secagg_plus",
            "rounds_completed": 5 * (i + 1) - (i >= 2),
            "rounds_aborted": int(i >= 2),
            "bytes_up": 1e6 * (i + 1),
            "bytes_down": 1e5 * (i + 1),
        }
    assert alerts_of(tmp_path / "a", rows)["secure_aggregation_aborted"] == [15.0]
    html = write_report(make_run_dir(tmp_path / "sa", rows)).read_text()
    assert 'id="fig-secure_aggregation"' in html
    assert "secure_aggregation_aborted" in html
    assert (
        'id="secure_aggregation"'
        not in write_report(make_run_dir(tmp_path / "none", make_rows(3))).read_text()
    )


def test_attack_panel_only_under_an_attack(tmp_path):
    rows = make_rows(3)
    assert 'id="attack"' not in write_report(make_run_dir(tmp_path / "plain", rows)).read_text()
    for i, row in enumerate(rows):
        row["attack"] = {
            "malicious": 2,
            "benign_global": {"accuracy": 0.5 + 0.1 * i},
            "backdoor_success": 0.2 * i,
        }
    html = write_report(make_run_dir(tmp_path / "attacked", rows)).read_text()
    assert 'id="fig-attack"' in html and "backdoor success" in html


def test_a_diverging_client_update_norm(tmp_path):
    """One client's own update norm grows 20x (the median does not move): fires at that
    evaluation, naming it; a NaN norm fires too; the threshold is monitor.alerts'."""
    rows = make_rows(6)
    first = rows[0]["monitor"]["client_update_norm"]["3"]
    rows[3]["monitor"]["client_update_norm"]["3"] = 20 * first
    rows[4]["monitor"]["client_update_norm"]["5"] = float("nan")
    run = load_run(make_run_dir(tmp_path / "run", rows))
    alerts = [a for a in evaluate_alerts(run) if a.rule == "client_update_norm_exploding"]
    assert [a.round for a in alerts] == [20.0, 25.0]
    assert "client 3 (" in alerts[0].message and "client 5 (nan" in alerts[1].message
    assert "update_norm_exploding" not in alerts_of(tmp_path / "b", rows)
    relaxed = with_alerts(update_norm_growth_client=30.0)
    assert alerts_of(tmp_path / "c", rows, config=relaxed)["client_update_norm_exploding"] == [25.0]


def test_a_client_whose_personalized_accuracy_collapses(tmp_path):
    """The case of pFedMac at lam 0.1 and one local epoch: one client at 0.0 while the mean
    stays high. Fires at the collapse, names the client (summary's ids), once per client."""
    rows = make_rows(6)
    for row in rows[2:]:
        row["client_accuracy"][7] = 0.0
    rows[4]["client_accuracy"][2] *= 0.3
    run = load_run(make_run_dir(tmp_path / "run", rows))
    alerts = [a for a in evaluate_alerts(run) if a.rule == "client_accuracy_collapse"]
    assert [a.round for a in alerts] == [15.0, 25.0]
    assert "client 7 (0.0%" in alerts[0].message and "client 2 (" in alerts[1].message
    assert rows[2]["personalized"]["accuracy_mean"] > 0.75  # the mean hides it
    # a 20% dip is not a collapse; off with null
    rows = make_rows(6)
    rows[3]["client_accuracy"][1] *= 0.8
    assert "client_accuracy_collapse" not in alerts_of(tmp_path / "dip", rows)
    rows[3]["client_accuracy"][1] = 0.0
    off = with_alerts(client_accuracy_drop=None)
    assert "client_accuracy_collapse" not in alerts_of(tmp_path / "off", rows, config=off)


def test_a_collapse_is_judged_only_on_clients_with_enough_test_samples(tmp_path):
    """The default run's false alarm (digits, 30 clients, FedAvg-FT): client 13 has 10 test
    samples, and its fine-tuned accuracy went 9/10 -> 2/10 -> 8/10 (rounds 35-45). Below
    ``client_accuracy_min_samples`` (20) it is not checked; the same fall to 0 on a client with
    60 test samples still fires, and so does the small client when the minimum allows it."""
    rows = make_rows(6)
    for row, acc in zip(rows, [0.7, 0.9, 0.9, 0.2, 0.8, 0.9], strict=True):
        row["client_accuracy"][13] = acc
    for row in rows[4:]:
        row["client_accuracy"][7] = 0.0
    sizes = {str(c): 60 for c in range(20)} | {"13": 10}

    def collapses(name: str, config=None) -> list:
        path = make_run_dir(tmp_path / name, rows, config=config, test_samples=sizes)
        return [a for a in evaluate_alerts(load_run(path)) if a.rule == "client_accuracy_collapse"]

    (alert,) = collapses("default")
    assert alert.round == 25.0 and alert.message.startswith("client 7 (0.0%")
    assert "at least 20 test samples" in alert.message
    small, big = collapses("ten", with_alerts(client_accuracy_min_samples=10))
    assert (small.round, big.round) == (20.0, 25.0)
    assert small.message.startswith("client 13 (20.0%, best 90.0%)")
    assert "at least 10 test samples" in small.message
    # a run that did not record the sizes (monitoring off): every client checked, and said so
    bare = load_run(make_run_dir(tmp_path / "bare", rows, label_histogram=False))
    unsized = [a for a in evaluate_alerts(bare) if a.rule == "client_accuracy_collapse"]
    assert [a.round for a in unsized] == [20.0, 25.0]
    assert "not recorded" in unsized[0].message


def test_dropped_nonfinite_clients(tmp_path):
    rows = make_rows(5)
    for row, count in zip(rows, [0, 0, 1, 1, 3], strict=True):
        row["dropped_nonfinite"] = count
    run = load_run(make_run_dir(tmp_path / "run", rows))
    (alert,) = [a for a in evaluate_alerts(run) if a.rule == "nonfinite_dropped"]
    assert alert.round == 15.0 and "3 client update(s)" in alert.message
    assert "by round 25" in alert.message
