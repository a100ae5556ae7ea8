"""Worker for tests/integration/test_comm.py: hierarchical vs flat gradient averaging on nodes x ranks.

Every rank trains two steps on its own batch with several DDP replicas of one tiny GPT-2:
torch's default all-reduce (the reference), then each hftk hook flat and hierarchical. After
every backward it records each replica's averaged gradient; rank 0 writes the comparisons,
the topology every rank saw, and the hierarchical byte counters to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from hftk.bench.comm_worker import JOB_DEFAULTS, batch_for, corpus_blocks, make_replica
from hftk.comm.accounting import log_fields
from hftk.comm.hierarchical import discover_topology
from hftk.config.options import ModelConfig
from hftk.models.loading import load_model, load_tokenizer

STEPS = 2
VARIANTS = [("none", False), ("none", True), ("fp16", False), ("fp16", True), ("topk", False), ("topk", True),
            ("powersgd", False), ("powersgd", True)]


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters())])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = ModelConfig(model_name_or_path="builtin:gpt2-tiny", model_dropout=0.0)
    blocks = corpus_blocks(load_tokenizer(model_cfg), 32)
    base = load_model(model_cfg)
    job = {**JOB_DEFAULTS, "bucket_cap_mb": 0.1, "powersgd_warmup_steps": 0, "topk_warmup_steps": 0, "lr": 1e-3}
    replicas = {(hook, hier): make_replica(base, hook, {**job, "hierarchical": hier}, torch.device("cpu"))
                for hook, hier in VARIANTS}
    plain = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)  # torch's own hook
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=job["lr"])
    report: dict = {"world_size": world, "steps": []}
    for step in range(STEPS):
        batch = batch_for(blocks, step, rank, world, 4)
        plain(input_ids=batch, labels=batch).loss.backward()
        ref = flat_grads(plain.module)
        row = {}
        for (hook, hierarchical), replica in replicas.items():
            replica.ddp(input_ids=batch, labels=batch).loss.backward()
            grads = flat_grads(replica.ddp.module)
            everyone = [torch.empty_like(grads) for _ in range(world)]
            dist.all_gather(everyone, grads)
            counters = log_fields(replica.state.stats.end_step())
            row[f"{hook}/{'hier' if hierarchical else 'flat'}"] = {
                "grads": grads, "same_on_all_ranks": all(torch.equal(g, everyone[0]) for g in everyone),
                "bytes": counters["comm_bytes_per_step"], "inter_node_bytes": counters["comm_inter_node_bytes_per_step"],
                "collectives": counters["comm_collectives_per_step"]}
            replica.optimizer.step()
            replica.optimizer.zero_grad(set_to_none=True)
        summary = {"ref_norm": float(ref.norm())}
        for name, data in row.items():
            hook = name.split("/")[0]
            flat = row[f"{hook}/flat"]["grads"]
            summary[name] = {
                "max_diff_vs_torch_default": float((data["grads"] - ref).abs().max()),
                "max_diff_vs_flat_same_hook": float((data["grads"] - flat).abs().max()),
                "rel_diff_vs_flat_same_hook": float((data["grads"] - flat).norm() / flat.norm()),
                **{k: v for k, v in data.items() if k != "grads"}}
        report["steps"].append(summary)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
    topology = discover_topology()
    seen: list = [None] * world
    dist.all_gather_object(seen, {"rank": rank, "GROUP_RANK": os.environ["GROUP_RANK"],
                                  "LOCAL_WORLD_SIZE": os.environ["LOCAL_WORLD_SIZE"], "nodes": topology.nodes,
                                  "leader": topology.is_leader})
    report["ranks"] = seen
    if rank == 0:
        Path(args.out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    main()
    exit_without_teardown(0)  # skips gloo's teardown abort
