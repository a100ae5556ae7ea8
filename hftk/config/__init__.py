"""What a user can ask for and what hftk supports: the typed config (``options``, single source of every
option), the strategy table (``strategy_table``) every check reads, and the strategy rules built from it
(``support``; what a model's structure allows is ``hftk.models.spec``'s).

Imports: ``core`` only.
"""
