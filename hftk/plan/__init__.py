"""The per-rank memory plan: its inputs, shapes and rows (``types``) and the data-parallel formulas,
``hftk plan`` and ``--strategy auto`` (``estimate``; tp / cp / sp rows come from their strategy modules
through the strategy table).

Imports: the layers below (``core`` .. ``models``).
"""
