"""Training engines: the HF Trainer path (``trainer``), the custom loop (``loop``), what both stop on
(``resilience``: preemption and NaN agreed by all ranks), generation samples during training (``samples``) and
what validation hands them (``run_types``).

Imports: the layers below (``core`` .. ``publish``).
"""
