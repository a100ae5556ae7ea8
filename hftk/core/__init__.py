"""Leaves every layer uses: the one-line error (``errors``), what a run prints (``output``), the glibc
allocator (``allocator``), the start-up clock (``startup``), torch elastic's agent store (``agent_store``).

Imports: nothing of hftk outside ``core`` (the bottom layer; see ``tests/unit/test_imports.py``).
"""
