"""Many short 2-rank gloo runs with rank telemetry timing every step's collectives (issue 50's crash check).

Each run forks 2 ranks that train a small GPT-2 for ``--steps`` steps under DDP or FSDP2 (alternating: DDP's
reducer completes futures on gloo's threads, FSDP2's reduce-scatter has none and is polled), with
``RankMonitor(comm_timing_every=1)`` entering and leaving its dispatch mode around every step, as
``--comm_profile_steps 1`` would. A run whose rank ends by a signal or a non-zero status counts as a crash; the
line printed at the end is what docs/testing.md records. Usage:
``python scripts/telemetry_stress.py --runs 300`` (beside CPU hogs for a loaded host).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def rank(rank: int, store: str, strategy: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from hftk.core.teardown import exit_without_teardown
    from hftk.telemetry.rank_monitor import RankMonitor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=64))
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = RankMonitor(torch.device("cpu"), comm_timing_every=1)
    monitor.attach(model)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    for step in range(1, steps + 1):
        monitor.step_begin(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end()
        summary = monitor.collect(model, optimizer)
        if summary is not None and not 0 < summary.scalars.get("comm_share", 0) < 1:
            raise SystemExit(f"step {step}: comm_share {summary.scalars.get('comm_share')} not in (0, 1)")
    dist.destroy_process_group()
    # As every hftk worker leaves (hftk.core.teardown): a DDP reducer freed later still holds the gloo group, whose
    # destructor joins gloo's threads with the GIL held while one of them frees a finished work's tensors and waits
    # for the GIL (a deadlock seen here in the third run under load; py-spy: ~ProcessGroupGloo, ~AsyncAllgatherWork).
    exit_without_teardown(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    crashes, started = [], time.time()
    for run in range(args.runs):
        strategy = ("ddp", "fsdp")[run % 2]
        with tempfile.TemporaryDirectory() as folder:
            context = mp.start_processes(rank, args=(os.path.join(folder, "store"), strategy, args.steps), nprocs=2,
                                         start_method="fork", join=False)
            try:
                while not context.join(timeout=120):
                    pass
                failure = ""
            except Exception as exc:  # torch's ProcessRaisedException / ProcessExitedException: the rank's end
                failure = f"{type(exc).__name__}: {exc}"
            codes = [p.exitcode for p in context.processes]
        if (run + 1) % 25 == 0:
            print(f"{run + 1} runs, {len(crashes)} crashed, {time.time() - started:.0f} s", flush=True)
        if failure or any(codes):
            crashes.append((run, strategy, codes))
            print(f"run {run} ({strategy}): exit codes {codes} {failure}", flush=True)
    print(f"telemetry stress: {args.runs} runs x 2 ranks x {args.steps} timed steps (ddp / fsdp alternating), "
          f"{len(crashes)} crashed, {time.time() - started:.0f} s", flush=True)
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
