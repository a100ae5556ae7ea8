"""Datasets in, batches out: load, detect the format, tokenise, mask, pack or pad, collate, split, mix
(``dataset``); chat templates and assistant-only labels (``chat`` + ``templates/``); the built-in names and
the shipped corpus (``builtin`` + ``corpus/``).

Imports: ``core``, ``config``, ``comm``, ``telemetry``.
"""
