"""What a run measures and writes as it trains: ``metrics.jsonl`` and the replica check (``metrics``), the
per-rank monitor (``rank_monitor``: peak memory, comm share, imbalance, MFU inputs), counted model-state
bytes (``memory``), generation samples as reported (``samples``).

Imports: ``core``, ``config``, ``comm``.
"""
