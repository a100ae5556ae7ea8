"""Leaves every layer uses: the one-line error (``errors``), what a run prints (``output``), the glibc
allocator (``allocator``), the start-up clock (``startup``), torch elastic's agent store (``agent_store``),
how a finished rank leaves (``teardown``).

Imports: nothing of hftk outside ``core`` (the bottom layer; see ``tests/unit/test_imports.py``).
"""
