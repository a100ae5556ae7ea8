"""glibc told to give freed memory back (hftk.core.allocator), each case in a fresh process: freed blocks
really leave the RSS, and a user's own setting wins."""

from __future__ import annotations

import json
import sys

import pytest

from hftk.core import allocator
from tests.helpers import run

# One 8 MiB block freed (glibc's default then raises its mmap threshold to 8 MiB), 64 blocks of 1 MiB
# written, a 48 KiB block above them, the 64 freed: what stays resident is what glibc kept.
CHURN = """
import ctypes, json, sys
from hftk.core import allocator
applied = allocator.return_freed_memory() if sys.argv[1] == "on" else {}
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block
libc.free(touched(8 << 20))
blocks = [touched(1 << 20) for _ in range(64)]
keeper = touched(48 << 10)  # from the top of the heap: nothing freed is that large
for block in blocks:
    libc.free(block)
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(json.dumps({"applied": applied, "rss_mib": rss / 1024}))
"""


def _churn(mode: str) -> dict:
    result = run([sys.executable, "-c", CHURN, mode], timeout=60)
    assert result.returncode == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture()
def no_malloc_env(monkeypatch):
    for name in [*allocator.SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_leaves_the_rss(no_malloc_env):
    default, tuned = _churn("off"), _churn("on")
    assert tuned["applied"] == {"MALLOC_MMAP_THRESHOLD_": 65536, "MALLOC_TRIM_THRESHOLD_": 0}
    assert tuned["rss_mib"] < default["rss_mib"] - 48, (default, tuned)  # 64 MiB kept by glibc's defaults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
                                 {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={32 << 20}"}],
                         ids=["variable", "tunable"])
def test_a_users_own_setting_wins(no_malloc_env, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the churn processes inherit it, as from a user's shell
    default, tuned = _churn("off"), _churn("on")
    assert tuned["applied"] == {"MALLOC_TRIM_THRESHOLD_": 0}  # only what the user left unset
    assert tuned["rss_mib"] > default["rss_mib"] - 8, (default, tuned)  # the user's 32 MiB threshold kept them
    assert allocator.effective() == {"MALLOC_MMAP_THRESHOLD_": env.get("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"),
                                     "MALLOC_TRIM_THRESHOLD_": "0"}
