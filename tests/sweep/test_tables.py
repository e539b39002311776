"""table.md and table.tex from a results.csv written here: mean ± sample standard deviation
over the finished seeds, computed by hand, and LaTeX's special characters escaped."""

from __future__ import annotations

from fedloom.sweep.results import columns, latex_escape, read_csv, write_csv, write_tables

KEYS = ["algorithm.name", "data.partition.alpha"]


def row(algorithm, alpha, seed, glob, mean, p10, best, spr, up, down, status="finished"):
    return {
        "algorithm.name": algorithm,
        "data.partition.alpha": alpha,
        "seed": seed,
        "final_global_accuracy_fraction": glob,
        "final_personalized_mean_fraction": mean,
        "final_personalized_p10_fraction": p10,
        "final_personalized_p50_fraction": mean,
        "final_personalized_p90_fraction": mean,
        "best_personalized_mean_fraction": best,
        "rounds": 10,
        "seconds_per_round": spr,
        "mb_up": up,
        "mb_down": down,
        "run_dir": f"runs/{algorithm}/seed_{seed}",
        "status": status,
        "error": "" if status == "finished" else "ConfigError: model.name: no",
    }


ROWS = [
    row("fedavg_ft", 0.1, 0, 0.80, 0.70, 0.5, 0.75, 0.1, 1.0, 2.0),
    row("fedavg_ft", 0.1, 1, 0.90, 0.74, 0.6, 0.75, 0.2, 1.0, 2.0),
    row("fedavg_ft", 0.1, 2, 0.85, 0.72, 0.7, 0.78, 0.3, 1.0, 2.0),
    # no global model (an empty cell), one seed finished and one failed
    row("ditto&co", 0.5, 0, None, 0.5, 0.25, 0.625, 1.5, 0.5, 0.25),
    row("ditto&co", 0.5, 1, None, None, None, None, None, None, None, status="failed"),
]


def test_tables_hold_mean_and_sample_std_over_finished_seeds(tmp_path):
    csv = tmp_path / "results.csv"
    write_csv(csv, columns(KEYS), ROWS)
    keys, rows = read_csv(csv)
    assert keys == KEYS and len(rows) == 5 and rows[3]["final_global_accuracy_fraction"] == ""
    assert rows[0]["final_global_accuracy_fraction"] == "0.8"  # fractions in the CSV
    md, tex = write_tables(csv, tmp_path)
    lines = md.read_text().splitlines()
    assert lines[0] == (
        "| algorithm.name | data.partition.alpha | Global acc. (%) | Pers. mean (%) | "
        "Pers. P10 (%) | Best pers. mean (%) | s/round | MB sent (up+down) | seeds |"
    )
    # global 80, 90, 85: mean 85, std sqrt((25 + 25 + 0) / 2) = 5; best 75, 75, 78: mean 76,
    # std sqrt((1 + 1 + 4) / 2) = 1.732; seconds 0.1, 0.2, 0.3: 0.2 ± 0.1; MB 1 + 2 each
    assert lines[2] == (
        "| fedavg_ft | 0.1 | 85.00 ± 5.00 | 72.00 ± 2.00 | 60.00 ± 10.00 | 76.00 ± 1.73 | "
        "0.200 ± 0.100 | 3.00 ± 0.00 | 3 |"
    )
    assert (
        lines[3] == "| ditto&co | 0.5 | – | 50.00 | 25.00 | 62.50 | 1.500 | 0.75 | 1 (1 failed) |"
    )
    body = tex.read_text().splitlines()
    assert "\\toprule" in body and "\\midrule" in body and "\\bottomrule" in body
    assert body[1] == "\\begin{tabular}{llrrrrrrr}"
    assert body[3] == (
        "algorithm.name & data.partition.alpha & Global acc. (\\%) & Pers. mean (\\%) & "
        "Pers. P10 (\\%) & Best pers. mean (\\%) & s/round & MB sent (up+down) & Seeds \\\\"
    )
    assert body[5] == (
        "fedavg\\_ft & 0.1 & $85.00 \\pm 5.00$ & $72.00 \\pm 2.00$ & $60.00 \\pm 10.00$ & "
        "$76.00 \\pm 1.73$ & $0.200 \\pm 0.100$ & $3.00 \\pm 0.00$ & 3 \\\\"
    )
    assert body[6] == (
        "ditto\\&co & 0.5 & -- & $50.00$ & $25.00$ & $62.50$ & $1.500$ & $0.75$ & 1 (1 failed) \\\\"
    )


def test_latex_escape():
    assert latex_escape("a_b & 50% $x$ #1 {y} ~z^2 \\o") == (
        "a\\_b \\& 50\\% \\$x\\$ \\#1 \\{y\\} \\textasciitilde{}z\\textasciicircum{}2 "
        "\\textbackslash{}o"
    )
    assert latex_escape("fedavg, alpha=0.1") == "fedavg, alpha=0.1"
