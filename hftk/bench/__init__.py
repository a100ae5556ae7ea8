"""``hftk bench``: measure what distribution buys (scaling, batch, overhead, memory, comm, pipeline, data) and
what a launch costs before its first step (startup).

Every sub-bench lives in its own module ``hftk/bench/<name>.py`` and exposes ``run_<name>_bench(out_dir:
Path, **options) -> dict``: it launches its own worker processes (under a timeout), writes raw files and
its PNG charts (matplotlib, Agg backend) under ``out_dir`` (the report gives each bench its own subfolder),
and returns a JSON-ready dict of *measured* figures. Two optional keys are read by the report
(:func:`hftk.bench.charts.finish` adds both):

- ``"table"``: ``{"title": str, "columns": [str, ...], "rows": [[cell, ...], ...]}`` shown in the
  markdown summary;
- ``"charts"``: PNG file names relative to ``out_dir``, linked from the summary.

:mod:`hftk.bench.report` turns those dicts into one report folder (``results.json``,
``summary.md``, the charts); :mod:`hftk.bench.cli` is the ``hftk bench`` command line.

Imports: anything in hftk (the top layer with ``hftk.cli``).
"""
