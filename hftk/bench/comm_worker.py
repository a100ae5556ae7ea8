"""Per-rank worker of ``hftk bench comm`` (and of the compression tests): raw DDP, one hook per replica.

Run under torchrun: ``-m hftk.bench.comm_worker --plan plan.json --out results.json``. Each job of the
plan trains one DDP replica per hook from the same initial weights on the same batches; with
``interleave`` the hooks take turns step by step (A B C A B C ...) so machine noise falls on all of
them alike. Every step records the hook's counters (bytes, collectives, in-flight time), wall and CPU
time, the exposed communication (hooks blocked on a collective, plus what was still in flight after
the last bucket was handed over: what backward waited for), and, with ``check_sync``, whether all
ranks hold bitwise-identical parameters.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hftk.comm.accounting import log_fields
from hftk.comm.collectives import gather_objects
from hftk.comm.register import register_compression
from hftk.config.options import ModelConfig, StrategyConfig
from hftk.data.builtin import CORPUS
from hftk.models.loading import load_model, load_tokenizer
from hftk.telemetry.metrics import parameter_digest

JOB_DEFAULTS: dict[str, Any] = {
    "model": "builtin:gpt2-tiny", "hooks": ["none", "fp16", "bf16", "powersgd", "topk"], "bucket_cap_mb": 25.0,
    "steps": 20, "block_size": 32, "batch": 4, "lr": 1e-3, "optimizer": "adamw", "max_grad_norm": 1.0, "powersgd_rank": 4,
    "powersgd_warmup_steps": 10, "topk_ratio": 0.01, "topk_warmup_steps": 10, "hierarchical": False, "check_sync": False,
    "interleave": True, "eval_batches": 4,
}


def corpus_blocks(tokenizer: Any, block_size: int) -> torch.Tensor:
    """The shipped corpus as one row of ``block_size`` token ids per block."""
    lines = tokenizer(CORPUS.read_text().splitlines(keepends=True))["input_ids"]
    ids = torch.tensor([t for line in lines for t in line], dtype=torch.long)
    n = ids.numel() // block_size
    return ids[: n * block_size].view(n, block_size)


def batch_for(blocks: torch.Tensor, step: int, rank: int, world: int, batch: int) -> torch.Tensor:
    """Rank ``rank``'s slice of step ``step``'s global batch (wrapping around the corpus)."""
    start = (step * world + rank) * batch
    return blocks[torch.arange(start, start + batch) % blocks.shape[0]]


@dataclasses.dataclass
class Replica:
    hook: str
    ddp: Any
    optimizer: Any
    state: Any
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def make_replica(base: Any, hook: str, job: dict[str, Any], device: torch.device) -> Replica:
    ddp = DistributedDataParallel(copy.deepcopy(base).to(device), bucket_cap_mb=job["bucket_cap_mb"])
    cfg = StrategyConfig(grad_compression=hook, powersgd_rank=job["powersgd_rank"],
                         powersgd_warmup_steps=job["powersgd_warmup_steps"], topk_ratio=job["topk_ratio"],
                         topk_warmup_steps=job["topk_warmup_steps"], hierarchical_allreduce=job["hierarchical"])
    state = register_compression(ddp, cfg)
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=job["lr"]) if job["optimizer"] == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=job["lr"], momentum=0.9))
    return Replica(hook=hook, ddp=ddp, optimizer=optimizer, state=state)


def train_step(replica: Replica, batch: torch.Tensor, max_grad_norm: float, check_sync: bool) -> None:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    loss = replica.ddp(input_ids=batch, labels=batch).loss
    loss.backward()
    stats = replica.state.stats
    exposed = stats.in_flight_since(stats.last_hook_end)
    torch.nn.utils.clip_grad_norm_(replica.ddp.parameters(), max_grad_norm)
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - wall0
    counters = log_fields(stats.end_step(), arrival_timed=stats.arrival_timed)
    record = {"loss": loss.item(), "wall_s": wall, "cpu_s": time.process_time() - cpu0, **counters}
    if stats.arrival_timed:  # NCCL's intervals time enqueueing: no exposed-communication figure from them
        record["exposed_comm_s"] = exposed + counters["comm_wait_s"]
    if check_sync:
        record["in_sync"] = len(set(gather_objects(parameter_digest(replica.ddp.module)))) == 1
    replica.records.append(record)


@torch.no_grad()
def eval_loss(replica: Replica, blocks: torch.Tensor, batch: int) -> float:
    """Mean loss over the held-out blocks (identical on every rank: the replicas are)."""
    losses = [replica.ddp.module(input_ids=blocks[i:i + batch], labels=blocks[i:i + batch]).loss.item()
              for i in range(0, blocks.shape[0], batch)]
    return sum(losses) / len(losses)


def run_job(job: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    job = {**JOB_DEFAULTS, **job}
    model_cfg = ModelConfig(model_name_or_path=job["model"], model_dropout=0.0)
    blocks = corpus_blocks(load_tokenizer(model_cfg), job["block_size"]).to(device)
    held_out = job["eval_batches"] * job["batch"]
    train_blocks, eval_blocks = blocks[:-held_out], blocks[-held_out:]
    base = load_model(model_cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [job["hooks"]] if job["interleave"] else [[hook] for hook in job["hooks"]]
    results = []
    for hooks in groups:
        replicas = [make_replica(base, hook, job, device) for hook in hooks]
        for step in range(job["steps"]):
            batch = batch_for(train_blocks, step, rank, world, job["batch"])
            for replica in replicas:
                train_step(replica, batch, job["max_grad_norm"], job["check_sync"])
        for replica in replicas:
            results.append({**{k: job[k] for k in JOB_DEFAULTS if k != "hooks"}, "name": job.get("name", ""),
                            "hook": replica.hook, "world_size": world, "steps_run": len(replica.records),
                            "params": sum(p.numel() for p in replica.ddp.module.parameters()),
                            "eval_loss": eval_loss(replica, eval_blocks, job["batch"]), "records": replica.records})
        del replicas
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="JSON file: {'jobs': [{...}, ...]} (keys: JOB_DEFAULTS).")
    parser.add_argument("--out", required=True, help="JSON results, written by rank 0.")
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        torch.manual_seed(0)
        results = [r for job in json.loads(Path(args.plan).read_text())["jobs"] for r in run_job(job, device)]
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    exit_without_teardown(main())  # skips gloo's teardown abort
