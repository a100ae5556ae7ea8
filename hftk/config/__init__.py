"""What a user can ask for and what hftk supports: the typed config (``options``, single source of every
option), the strategy table (``strategy_table``) and the model-family table (``family_table``) every check
reads, and the support matrix built from them (``support``).

Imports: ``core`` only.
"""
