"""``hftk bench``: measure what distribution buys (scaling, batch, overhead, memory, comm, pipeline).

Each sub-bench lives in its own module and exposes ``run_<name>_bench(out_dir, ...) -> dict``:
it launches its own worker processes, writes whatever raw files it likes under ``out_dir``,
and returns a JSON-ready dict of measured figures. :mod:`hftk.bench.report` turns those dicts
into one report folder (``results.json``, ``summary.md``, PNG charts); :mod:`hftk.bench.cli`
is the command line.
"""
