"""Two hosts (network namespaces joined by veth when root, else loopback): multi-node runs
equal a single-node run with the same global batch."""

from __future__ import annotations

import pytest

from tests.helpers import FINETUNE, TINY_ARGS, finetune, losses, metrics
from tests.netns import run_on_two_hosts

pytestmark = pytest.mark.slow
STEPS = 5
GLOBAL_BATCH = 8


def run_two_nodes(out, nproc: int, args: list[str], timeout: float = 420) -> None:
    """One torchrun per host, both writing to one output dir (a shared file system)."""
    per_rank = GLOBAL_BATCH // (2 * nproc)
    full = [*TINY_ARGS, "--max_steps", str(STEPS), "--output_dir", str(out), "--check_sync_steps", "1",
            "--per_device_train_batch_size", str(per_rank), *args]
    run_on_two_hosts(FINETUNE, full, nproc, timeout)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    finetune(1, ["--max_steps", str(STEPS), "--output_dir", str(root / "single"),
                 "--per_device_train_batch_size", str(GLOBAL_BATCH)])
    run_two_nodes(root / "2x1", 1, [])
    run_two_nodes(root / "2x2", 2, [])
    return root


@pytest.mark.parametrize("layout,world", [("2x1", 2), ("2x2", 4)])
def test_ddp_two_nodes_match_single_node(ddp_runs, layout, world):
    ref, got = losses(ddp_runs / "single"), losses(ddp_runs / layout)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (layout, step)
    sync = [m for m in metrics(ddp_runs / layout) if "ranks_in_sync" in m]
    assert len(sync) == STEPS and all(m["ranks_in_sync"] and len(m["param_digests"]) == world for m in sync)
