"""The eval report: result folders → report.md (tables per configuration and benchmark, with intervals), summary.json
and plots. `write_report` (in `markdown`) is what `ermedrag report` calls."""

from ermedrag.evals.report.markdown import write_report
from ermedrag.evals.report.plots import config_colours
from ermedrag.evals.report.results import compare_configurations, load_results, load_rows

__all__ = ["compare_configurations", "config_colours", "load_results", "load_rows", "write_report"]
