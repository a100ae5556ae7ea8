"""glibc's allocator told to give freed memory back, so a CPU rank's RSS follows what it holds.

With its defaults glibc raises its mmap threshold each time a large block is freed (up to 32 MiB)
and keeps freed heap resident: after a few steps a rank's RSS holds every transient buffer it ever
had (gathered FSDP blocks, gradient buckets, logits), and sharding saves nothing on CPU (measured
in docs/benchmarks.md, "CPU memory"). ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``
fixes that, but glibc reads those variables only when a process starts; ``mallopt`` sets the same
two parameters in a running process (and, like the variables, turns the dynamic threshold off).
:func:`hftk.run.prepare.prepare` calls :func:`return_freed_memory` before any model exists, so every
engine, bench and test worker runs with it. A setting the user gave through the environment
(the variable or ``GLIBC_TUNABLES``) wins; on another C library nothing is changed. The price is
kernel time: freed pages fault in again on their next use (docs/benchmarks.md: +40-65% CPU per step on CPU).
"""

from __future__ import annotations

import ctypes
import os
import sys

# (mallopt parameter from <malloc.h>, value, the glibc tunable of the same parameter)
SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 65536, "glibc.malloc.mmap_threshold"),  # M_MMAP_THRESHOLD: 64 KiB
    "MALLOC_TRIM_THRESHOLD_": (-1, 0, "glibc.malloc.trim_threshold"),  # M_TRIM_THRESHOLD: trim every free
}


def user_set(env_name: str) -> bool:
    """Whether the user chose this parameter at process start (variable or glibc tunable)."""
    return env_name in os.environ or f"{SETTINGS[env_name][2]}=" in os.environ.get("GLIBC_TUNABLES", "")


def return_freed_memory() -> dict[str, int]:
    """Apply every setting the user did not choose; returns what was applied ({} off glibc)."""
    if not sys.platform.startswith("linux"):
        return {}
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl: another allocator, other knobs
        return {}
    applied = {}
    for name, (param, value, _) in SETTINGS.items():
        if not user_set(name) and libc.mallopt(param, value) == 1:
            applied[name] = value
    return applied


def effective() -> dict[str, str]:
    """What a process started now runs with: the user's value where they chose one, else hftk's."""
    return {name: os.environ.get(name, "GLIBC_TUNABLES") if user_set(name) else str(value)
            for name, (_, value, _) in SETTINGS.items()}
