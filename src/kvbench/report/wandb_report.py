"""``kvbench.report DIR --wandb-report``: a W&B report of a results folder (wandb-workspaces API).

The report holds the markdown report (the tables, as rendered from the records), its provenance,
and a panel grid over the experiment's runs: score against compression, the accuracy drop per
stack and a run comparer. It is created only where the API is installed and W&B is online (an
API key, not ``WANDB_MODE=offline``); otherwise kvbench says what it would create and why not.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any


def blocks_plan(title: str, project: str, entity: str | None) -> list[str]:
    """The report's blocks, in words (what is printed when it cannot be created)."""
    where = f"{entity}/{project}" if entity else project
    return [
        f"H1 {title!r}",
        "P: what the report is, and that every number comes from kvbench records",
        f"Markdown: {title}/REPORT.md (the matrix tables, sanity checks, provenance)",
        f"Panel grid over the runs of {where} in group {title!r}: scatter score/value against "
        "compression_mean, bar accuracy_drop/value per run, run comparer",
    ]


def why_offline() -> str | None:
    """Why a report cannot be created here, or None when it can."""
    if importlib.util.find_spec("wandb_workspaces") is None:
        return "the wandb-workspaces package is not installed (pip install wandb-workspaces)"
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    if not os.environ.get("WANDB_API_KEY"):
        return "no WANDB_API_KEY"
    return None


def build(folder: Path, project: str, entity: str | None) -> Any:
    """The ``wandb_workspaces`` Report object for ``folder`` (not saved)."""
    import wandb_workspaces.reports.v2 as wr

    title = folder.resolve().name
    markdown = (folder / "REPORT.md").read_text(encoding="utf-8")
    runs = wr.Runset(entity=entity or "", project=project, name=title, groupby=["group"])
    return wr.Report(
        entity=entity or "",
        project=project,
        title=f"kvbench: {title}",
        description="KV-cache compression matrix measured by kvbench on real caches.",
        blocks=[
            wr.H1(f"kvbench: {title}"),
            wr.P("Every number below was measured in the run that reports it; see the provenance lines."),
            wr.MarkdownBlock(text=markdown),
            wr.PanelGrid(
                runsets=[runs],
                panels=[
                    wr.ScatterPlot(title="score against compression", x="compression_mean", y="score/value"),
                    wr.BarPlot(title="accuracy drop", metrics=["accuracy_drop/value"]),
                    wr.RunComparer(),
                ],
            ),
        ],
    )


def create_or_explain(folder: Path, project: str, entity: str | None) -> tuple[bool, list[str]]:
    """Creates the report where possible; returns (created, lines to print)."""
    reason = why_offline()
    title = folder.resolve().name
    if reason is not None:
        lines = [f"kvbench-report: not creating a W&B report: {reason}. It would hold:"]
        return False, lines + [f"  - {b}" for b in blocks_plan(title, project, entity)]
    report = build(folder, project, entity)
    report.save()
    return True, [f"kvbench-report: W&B report created: {report.url}"]
