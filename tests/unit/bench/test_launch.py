"""hftk/bench/launch.py: which command starts a bench's ranks."""

from __future__ import annotations

import sys

from hftk.bench.launch import LAUNCHER_ENV, bench_command


def test_bench_launches_use_torchrun_unless_a_launcher_is_named_and_startup_always_does(monkeypatch):
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    torchrun = bench_command(2, "-m", "hftk.bench.worker", "spec.json")
    assert torchrun[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in torchrun
    assert torchrun[-3:] == ["-m", "hftk.bench.worker", "spec.json"]
    monkeypatch.setenv(LAUNCHER_ENV, "/opt/site/launch --quiet 'a b'")
    assert bench_command(2, "-m", "hftk.bench.worker", "spec.json") == [
        "/opt/site/launch", "--quiet", "a b", "--nproc_per_node=2", "--nnodes=1", "-m", "hftk.bench.worker", "spec.json"]
    assert bench_command(2, "script.py", real_torchrun=True)[:3] == [sys.executable, "-m", "torch.distributed.run"]
