"""Two hosts (network namespaces joined by veth when root, else loopback): multi-node runs
equal a single-node run with the same global batch."""

from __future__ import annotations

import pytest

from tests.helpers import FINETUNE, TINY_ARGS, finetune, load_weights, losses, max_weight_diff, metrics
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


LAYOUTS = {"2x1": 1, "2x2": 2}  # nodes x processes per node -> processes per node
STRATEGIES = {"ddp": [], "zero3": ["--strategy", "zero3"], "fsdp_hybrid": ["--strategy", "fsdp", "--fsdp_hybrid", "true"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-node reference, then every strategy x layout on two hosts."""
    root = tmp_path_factory.mktemp("multinode")
    finetune(1, ["--max_steps", str(STEPS), "--output_dir", str(root / "single"),
                 "--per_device_train_batch_size", str(GLOBAL_BATCH)])
    for strategy, args in STRATEGIES.items():
        for layout, nproc in LAYOUTS.items():
            if strategy == "fsdp_hybrid" and nproc == 1:
                continue  # one process per node leaves nothing to shard inside a node
            run_two_nodes(root / f"{strategy}-{layout}", nproc, args)
    return root


CASES = [(s, layout) for s in STRATEGIES for layout in LAYOUTS if not (s == "fsdp_hybrid" and layout == "2x1")]


@pytest.mark.parametrize("strategy,layout", CASES, ids=[f"{s}-{layout}" for s, layout in CASES])
def test_two_nodes_match_single_node(runs, strategy, layout):
    ref, got = losses(runs / "single"), losses(runs / f"{strategy}-{layout}")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (strategy, layout, step)
    final = load_weights(runs / f"{strategy}-{layout}" / "final")
    assert max_weight_diff(load_weights(runs / "single" / "final"), final) < 1e-5


@pytest.mark.parametrize("strategy,layout", [("ddp", "2x1"), ("ddp", "2x2"), ("fsdp_hybrid", "2x2")])
def test_replicas_stay_in_sync_across_nodes(runs, strategy, layout):
    """Replicated copies (DDP ranks; HSDP's per-node replicas, gathered) are bitwise equal every step."""
    world = 2 * LAYOUTS[layout]
    sync = [m for m in metrics(runs / f"{strategy}-{layout}") if "ranks_in_sync" in m]
    assert len(sync) == STEPS and all(m["ranks_in_sync"] and len(m["param_digests"]) == world for m in sync)
