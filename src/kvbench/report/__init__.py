"""Reports rendered from result records only: markdown tables of the experiment matrix."""

from kvbench.report.document import render_report
from kvbench.report.tables import DASH, format_row, render_table

__all__ = ["DASH", "format_row", "render_report", "render_table"]
