"""The dashboard's HTML: the run list and the live run page (same panels as report.html).

Pages use the report's style (``report.html.CSS``). The run page draws its figures in the
browser from the JSON that ``run_payload`` builds with ``report.panels.build_panels``, and
polls for a new version every ``POLL_MS`` milliseconds, redrawing with ``Plotly.react``.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any
from urllib.parse import quote

from fedloom.dashboard.runs import Entry, RunsFolder, age, script_json
from fedloom.report import format as fmt
from fedloom.report.alerts import evaluate_alerts
from fedloom.report.compare import COMPARE_CSS, alerts_cell
from fedloom.report.html import (
    CSS,
    PLOTLY_CONFIG,
    alerts_html,
    cards_html,
    cost_cards,
    quality_cards,
)
from fedloom.report.panels import build_panels
from fedloom.report.rundir import RunData, dig

PLOTLY_URL = "/static/plotly.min.js"
POLL_MS = 1500
POLL_FINISHED_MS = 5000

DASHBOARD_CSS = """
a { color: var(--accent); }
a.back { text-decoration: none; font-size: 13px; }
.roundline { margin-top: 10px; font-size: 15px; color: var(--soft); }
#round-counter { font-size: 22px; font-weight: 700; color: var(--ink);
  font-variant-numeric: tabular-nums; }
.live { font-size: 12px; font-weight: 600; color: var(--ok); letter-spacing: .04em; }
.live::before { content: "●"; margin-right: 4px; }
.live.lost { color: #b3261e; }
.live.idle { color: var(--soft); }
table.runs td { vertical-align: middle; }
table.runs td.name a { font-weight: 600; text-decoration: none; }
.toolbar { display: flex; gap: 12px; align-items: center; margin: 4px 0 8px; }
button { font: inherit; font-weight: 600; background: var(--accent); color: #fff; border: 0;
  border-radius: 8px; padding: 7px 14px; cursor: pointer; }
button:disabled { background: #9aa4b1; cursor: default; }
.hint { color: var(--soft); font-size: 13px; }
.error { background: #fdecea; border: 1px solid #f3b7b0; color: #8a1c12; border-radius: 10px;
  padding: 12px 16px; }
"""


def page(title: str, body: str, *, scripts: str = "") -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)} · fedloom dashboard</title>\n"
        '<link rel="icon" href="data:,">\n'
        f"<style>{CSS}{COMPARE_CSS}{DASHBOARD_CSS}</style>\n</head>\n"
        f'<body>\n<main class="page">\n{body}\n</main>\n{scripts}</body>\n</html>\n'
    )


def message_page(title: str, message: str) -> str:
    """An error or hint page with a link back to the run list."""
    return page(
        title,
        f'<header class="run"><a class="back" href="/">← all runs</a>'
        f"<h1>{escape(title)}</h1></header>"
        f'<p class="error">{escape(message)}</p>',
    )


def run_href(name: str) -> str:
    return "/runs/" + quote(name, safe="")


# --- the run list -----------------------------------------------------------


def _progress(entry: Entry) -> str:
    facts = entry.facts
    if facts is None or facts.last_round is None:
        text = fmt.MISSING
    else:
        text = fmt.integer(facts.last_round)
    if facts is not None and facts.planned_rounds is not None:
        text += f" / {fmt.integer(facts.planned_rounds)}"
    return text


def runs_json(folder: RunsFolder) -> dict[str, Any]:
    """The run list as data and as the table body's HTML (one renderer for both)."""
    entries = folder.entries()
    runs = [
        {
            "name": e.name,
            "status": e.facts.status if e.facts else "unreadable",
            "last_round": e.facts.last_round if e.facts else None,
            "algorithm": e.facts.algorithm if e.facts else None,
            "dataset": e.facts.dataset if e.facts else None,
            "best_personalized_mean": e.facts.best_personalized_mean if e.facts else None,
            "version": e.version,
        }
        for e in entries
    ]
    return {"root": str(folder.root), "runs": runs, "rows_html": _rows_html(entries, folder)}


def _rows_html(entries: list[Entry], folder: RunsFolder) -> str:
    if not entries:
        return (
            '<tr class="empty"><td colspan="9" class="hint">No runs here yet. Start one with '
            f"<code>fedloom run --out {escape(str(folder.root))}/NAME</code>; it appears "
            "within seconds.</td></tr>"
        )
    rows = []
    for e in entries:
        name = escape(e.name)
        if e.facts is None:
            status = '<span class="status running">unreadable</span>'
            cells = f'<td colspan="5" class="hint">{escape(e.error or "")}</td>'
        else:
            f = e.facts
            cls = "done" if f.status == "finished" else "running"
            status = f'<span class="status {cls}">{escape(f.status)}</span>'
            cells = (
                f"<td>{escape(str(f.algorithm or fmt.MISSING))}</td>"
                f"<td>{escape(str(f.dataset or fmt.MISSING))}</td>"
                f'<td class="num" data-col="round">{escape(_progress(e))}</td>'
                f'<td class="num" data-col="best">{fmt.percent(f.best_personalized_mean)}</td>'
                f'<td data-col="alerts">{alerts_cell(f.alerts)}</td>'
            )
        rows.append(
            f'<tr data-run="{name}">'
            f'<td><input type="checkbox" name="run" value="{name}" aria-label="select {name}">'
            f'</td><td class="name"><a href="{escape(run_href(e.name))}">{name}</a></td>'
            f'<td data-col="status">{status}</td>{cells}'
            f'<td class="hint">{escape(age(e.updated))}</td></tr>'
        )
    return "".join(rows)


INDEX_JS = """
(function () {
  const body = document.getElementById("runs-body");
  const button = document.getElementById("compare-button");
  function sync() {
    button.disabled = !body.querySelector("input[name=run]:checked");
  }
  body.addEventListener("change", sync);
  async function poll() {
    try {
      const r = await fetch("/api/runs", {cache: "no-store"});
      if (r.ok) {
        const data = await r.json();
        const checked = new Set(
          [...body.querySelectorAll("input[name=run]:checked")].map((i) => i.value));
        body.innerHTML = data.rows_html;
        body.querySelectorAll("input[name=run]").forEach((i) => {
          i.checked = checked.has(i.value);
        });
        sync();
      }
    } catch (e) { /* the server is gone: keep the last list */ }
    setTimeout(poll, 2000);
  }
  sync();
  setTimeout(poll, 2000);
})();
"""


def index_page(folder: RunsFolder) -> str:
    data = runs_json(folder)
    body = (
        '<header class="run"><div class="eyebrow">fedloom dashboard</div><h1>Runs</h1>'
        f'<div class="path">{escape(str(folder.root))}</div></header>'
        '<form action="/compare" method="get"><section class="panel wide">'
        '<div class="toolbar"><button type="submit" id="compare-button">Compare selected'
        '</button><span class="hint">Tick the runs to overlay on one page. The list '
        "refreshes by itself.</span></div>"
        '<div class="scroll"><table class="compare runs"><thead><tr><th></th><th>Run</th>'
        '<th>Status</th><th>Algorithm</th><th>Dataset</th><th class="num">Round</th>'
        '<th class="num">Best pers. mean</th><th>Alerts</th><th>Updated</th></tr></thead>'
        f'<tbody id="runs-body">{data["rows_html"]}</tbody></table></div></section></form>'
    )
    return page("Runs", body, scripts=f"<script>{INDEX_JS}</script>\n")


# --- one run ----------------------------------------------------------------


def _notes_html(run: RunData) -> str:
    notes = list(run.notes)
    if not run.rounds:
        notes.insert(0, "No evaluated round yet: the figures appear after the first one.")
    if not notes:
        return ""
    items = "".join(f"<li>{escape(n)}</li>" for n in notes)
    return f'<section class="notes"><ul>{items}</ul></section>'


def _round_value(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def run_payload(entry: Entry) -> dict[str, Any]:
    """Everything the run page shows, as JSON: round, status, cards, notes and each panel
    of ``build_panels`` (its figure as Plotly JSON, or the note saying why there is none)."""
    run, facts = entry.run, entry.facts
    assert run is not None and facts is not None
    panels = []
    for panel in build_panels(run):
        figure = json.loads(panel.figure.to_json()) if panel.figure is not None else None
        panels.append(
            {
                "key": panel.key,
                "title": panel.title,
                "caption": panel.caption,
                "note": panel.note,
                "wide": panel.wide,
                "figure": figure,
            }
        )
    return {
        "name": entry.name,
        "version": entry.version,
        "round": _round_value(facts.last_round),
        "planned": _round_value(facts.planned_rounds),
        "status": facts.status,
        "cards_html": cards_html(quality_cards(run), "quality")
        + cards_html(cost_cards(run), "cost"),
        "notes_html": _notes_html(run),
        "alerts_html": alerts_html(evaluate_alerts(run)) if run.rounds else "",
        "panels": panels,
    }


RUN_JS = """
(function () {
  const CONFIG = __CONFIG__;
  const API = __API__;
  let version = null;
  let layoutKey = null;
  const $ = (id) => document.getElementById(id);
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text) node.textContent = text;
    return node;
  }
  function setLive(state, text) {
    const live = $("live");
    live.className = "live " + state;
    live.textContent = text;
  }
  function render(p) {
    version = p.version;
    $("round-counter").textContent = p.round === null ? "—" : String(p.round);
    $("round-total").textContent = p.planned === null ? "" : " of " + p.planned;
    const status = $("status");
    status.textContent = p.status;
    status.className = "status " + (p.status === "finished" ? "done" : "running");
    $("cards").innerHTML = p.cards_html;
    $("notes").innerHTML = p.notes_html;
    $("alerts-slot").innerHTML = p.alerts_html;
    const root = $("figures");
    const key = p.panels.map((x) => x.key + (x.figure ? "+" : "-")).join(",");
    if (key !== layoutKey) {  // panels came or went: rebuild the page's slots
      root.querySelectorAll(".js-plotly-plot").forEach((d) => Plotly.purge(d));
      root.replaceChildren();
      for (const panel of p.panels) {
        const section = el("section", "panel" + (panel.wide ? " wide" : ""));
        section.id = "panel-" + panel.key;
        section.append(el("h2", "", panel.title), el("p", "caption"),
                       el("p", panel.figure ? "note" : "missing"));
        if (panel.figure) {
          const div = el("div", "plot");
          div.id = "fig-" + panel.key;
          section.append(div);
        }
        root.append(section);
      }
      layoutKey = key;
    }
    for (const panel of p.panels) {
      const section = $("panel-" + panel.key);
      section.querySelector("h2").textContent = panel.title;
      section.querySelector(".caption").textContent = panel.caption;
      const note = section.querySelector(".note, .missing");
      note.textContent = panel.note;
      note.hidden = !panel.note;
      if (panel.figure) {
        Plotly.react("fig-" + panel.key, panel.figure.data, panel.figure.layout, CONFIG);
      }
    }
  }
  async function poll() {
    let delay = __POLL__;
    try {
      const r = await fetch(API + "?since=" + encodeURIComponent(version), {cache: "no-store"});
      if (!r.ok) throw new Error("HTTP " + r.status);
      const p = await r.json();
      if (!p.unchanged) render(p);
      if (p.status === "finished") {
        setLive("idle", "up to date");
        delay = __POLL_FINISHED__;
      } else {
        setLive("", "live");
      }
    } catch (e) {
      setLive("lost", e instanceof TypeError ? "no connection to the dashboard"
                                              : "update failed: " + e.message);
    }
    setTimeout(poll, delay);
  }
  render(JSON.parse($("initial").textContent));
  setTimeout(poll, __POLL__);
})();
"""


def run_page(entry: Entry, payload: dict[str, Any]) -> str:
    """The run page: header, round counter, cards and the report's panels (drawn by JS)."""
    run = entry.run
    assert run is not None and entry.facts is not None
    facts = entry.facts
    title = str(facts.algorithm or "run") + (f" on {facts.dataset}" if facts.dataset else "")
    chips = [
        ("model", dig(run.config, "model", "name")),
        ("clients", dig(run.config, "data", "num_clients")),
        ("seed", run.config.get("seed")),
        ("partition", dig(run.config, "data", "partition", "kind")),
    ]
    chip_html = "".join(
        f'<span class="chip"><span class="k">{escape(k)}</span> {escape(str(v))}</span>'
        for k, v in chips
        if v is not None
    )
    rnd, planned = payload["round"], payload["planned"]
    status_cls = "done" if facts.status == "finished" else "running"
    live, live_cls = ("up to date", "live idle") if status_cls == "done" else ("live", "live")
    body = (
        '<header class="run"><a class="back" href="/">← all runs</a>'
        f'<div class="eyebrow">fedloom dashboard <span id="status" class="status {status_cls}">'
        f'{escape(facts.status)}</span><span id="live" class="{live_cls}">{live}</span></div>'
        f"<h1>{escape(title)}</h1>"
        f'<div class="chips">{chip_html}</div>'
        '<div class="roundline">Round <span id="round-counter">'
        f"{fmt.MISSING if rnd is None else escape(str(rnd))}</span>"
        f'<span id="round-total">{"" if planned is None else f" of {planned}"}</span></div>'
        f'<div class="path">{escape(str(entry.path))} · '
        f'<a href="{escape(run_href(entry.name))}/report">static report</a></div></header>'
        f'<div id="cards">{payload["cards_html"]}</div>'
        f'<div id="alerts-slot">{payload["alerts_html"]}</div>'
        f'<div id="notes">{payload["notes_html"]}</div>'
        '<div class="figures" id="figures"></div>'
    )
    js = (
        RUN_JS.replace("__CONFIG__", json.dumps(PLOTLY_CONFIG))
        .replace("__API__", json.dumps("/api" + run_href(entry.name)))
        .replace("__POLL_FINISHED__", str(POLL_FINISHED_MS))
        .replace("__POLL__", str(POLL_MS))
    )
    scripts = (
        f'<script src="{PLOTLY_URL}"></script>\n'
        f'<script id="initial" type="application/json">{script_json(payload)}</script>\n'
        f"<script>{js}</script>\n"
    )
    return page(title, body, scripts=scripts)
