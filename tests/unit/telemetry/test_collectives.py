"""The collective timer on 2 gloo processes: DDP's reducer, the Python API (blocking, async, and a work without a
future: FSDP2's reduce-scatter) and DTensor's
functional collectives are each timed from issue to completion, other ops not at all, and a late
completion callback after the mode is left still lands."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hftk.comm.accounting import union_length
from hftk.telemetry.collectives import CollectiveTimer

LATE = 0.4  # rank 1 joins each collective this late: rank 0's spans must cover the wait


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    spans: dict[str, list[tuple[float, float]]] = {}
    for name in ("ddp", "blocking", "async", "unfutured", "functional", "none"):
        dist.barrier()
        timer = CollectiveTimer()
        with timer:
            if rank == 1 and name != "none":
                time.sleep(LATE)
            if name == "ddp":
                ddp(torch.ones(4, 8)).sum().backward()
            elif name == "blocking":
                dist.all_reduce(torch.ones(3))
            elif name == "async":
                work = dist.all_reduce(torch.ones(3), async_op=True)
            elif name == "unfutured":  # FSDP2's gradient reduction: gloo gives this work no future
                dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), async_op=True).wait()
            elif name == "functional":
                funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()
            else:
                torch.ones(64, 64) @ torch.ones(64, 64)
        if name == "async":
            work.wait()  # completes after the mode was left: its callback still records
        assert _get_current_dispatch_mode() is None
        spans[name] = list(timer.spans)
    torch.save(spans, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_kind_of_collective_is_timed_from_issue_to_completion(tmp_path: Path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    spans = torch.load(tmp_path / "0.pt", weights_only=True)
    assert spans["none"] == []
    for name in ("ddp", "blocking", "async", "unfutured", "functional"):
        assert len(spans[name]) >= 1, (name, spans)
        # rank 0 waited for rank 1 inside the collective: the span holds the wait, and nothing unbounded
        assert LATE * 0.8 < union_length(spans[name]) < LATE + 5, (name, spans[name])
