"""Run reports: one offline, self-contained HTML page per run directory."""

from fedloom.report.html import REPORT_FILE, render_report, write_report
from fedloom.report.rundir import RunData, load_run

__all__ = ["REPORT_FILE", "RunData", "load_run", "render_report", "write_report"]
