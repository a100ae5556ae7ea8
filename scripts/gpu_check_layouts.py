"""The multi-rank layouts of scripts/gpu_check.sh, built and stepped once on ONE device.

Each layout runs in this one process as rank 0 of torch's fake process group
(``dist.init_process_group("fake", ...)``: collectives return at once; all-gathers and
all-to-alls fill their outputs from the local input), through hftk's own code: the strategy's
``layout`` (mesh, tensor parallel plan, ring attention, Ulysses, FSDP2), the mesh loop's
``build_optimizer`` and ``train_step`` (forward, backward, gradient reduction, clipping, AdamW).
A row passes when the loss and gradient norm are finite, every parameter moved, and the
parameters are the DTensors (placements, local shard shapes) the layout promises. The numbers are
not compared with a reference: under the fake group they are not the multi-rank run's.

pp2 cannot run on the fake group: a pipeline stage receives its input activations, gradients and
its neighbour's shapes by point-to-point recv, which the fake group leaves unfilled (tried with
``pipeline.build_runtime`` at pp_size 2 as rank 0 and as rank 1: ``PipelineStage``'s shape exchange
read an object size from an unfilled buffer and tried to allocate ~1.4e14 bytes). Its one-device equivalent here is hftk's
2-stage cut of the model (``pipeline.build_runtime``) on one rank, driven by torch's interleaved
schedule, which hands activations and gradients between two stages of the same rank in memory.

usage: python scripts/gpu_check_layouts.py [--dtypes fp32,bf16] [--device cuda|cpu]
Prints one row per layout and dtype; exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import traceback
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

SEQ, BATCH = 64, 2
OPTIM = SimpleNamespace(weight_decay=0.0, learning_rate=1e-3, adam_epsilon=1e-8, adam_beta1=0.9, adam_beta2=0.999,
                        optim="adamw_torch")
NOTE = "fake process group: collectives are no-ops, so losses are checked finite, not against a reference"


def small_llama() -> Any:
    """A Llama-shaped model from a config (random weights): GQA heads split 2 ways for tp and sp."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def fake_group(world_size: int) -> None:
    """Rank 0 of a fake process group of ``world_size`` (a previous one torn down)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def batch(device: str, vocab: int) -> dict[str, torch.Tensor]:
    """What the collator hands a mesh step: token ids, and labels equal to them."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def moved(before: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Parameters the optimizer step left unchanged (should be none)."""
    after = snapshot(model)
    return [n for n in before if torch.equal(before[n], after[n])]


def placements(param: Any) -> tuple[str, ...]:
    """``S0`` for a shard along dim 0 (FSDP2's strided shard over a tp shard included), ``S1``, ``R``, ``P``."""
    return tuple(f"S{p.dim}" if hasattr(p, "dim") else type(p).__name__[0] for p in getattr(param, "placements", ()))


def local_rows(param: Any) -> int:
    return (param.to_local() if hasattr(param, "to_local") else param).shape[0]


def check(condition: bool, problem: str) -> None:
    if not condition:
        raise AssertionError(problem)


def mesh_layout(strategy: str, world: int, args: list[str], expect: Callable[[Any], None]) -> Callable[..., str]:
    """A tp / cp / sp layout: hftk's ``layout`` then one step as the custom loop takes it; ``expect`` checks
    the sharding."""

    def step(device: str, dtype: torch.dtype | None) -> str:
        from hftk.config import strategy_table
        from hftk.config.options import load_config
        from hftk.strategies.mesh import MeshStep

        fake_group(world)
        cfg = load_config(["--model_name_or_path", "builtin:llama-tiny", "--strategy", strategy, *args])
        model = small_llama().to(device)
        layout = strategy_table.get(strategy).layout(model, cfg, device)
        layout = dataclasses.replace(layout, autocast_dtype=dtype)
        expect(layout)
        before = snapshot(layout.model)
        mesh_step = MeshStep(layout, torch.device(device))
        optimizer = torch.optim.AdamW(mesh_step.param_groups(OPTIM.weight_decay), lr=OPTIM.learning_rate,
                                      eps=OPTIM.adam_epsilon, betas=(OPTIM.adam_beta1, OPTIM.adam_beta2))
        loss = mesh_step.forward_backward([batch(device, model.config.vocab_size)])
        grad_norm = mesh_step.clip_gradients(1.0)
        optimizer.step()
        check(math.isfinite(loss), f"loss {loss}")
        check(math.isfinite(grad_norm), f"grad norm {grad_norm}")
        still = moved(before, layout.model)
        check(not still, f"{len(still)} parameters unchanged by the step, e.g. {still[:2]}")
        return f"loss {loss:.3f}, grad norm {grad_norm:.3f}"

    return step


def sharded(tp: int, shards: int) -> Callable[[Any], None]:
    """q_proj split over tp then FSDP2 (local rows 1/(tp*shards)); the norms replicated over tp, sharded by FSDP2."""

    def expect(layout: Any) -> None:
        params = dict(layout.model.named_parameters())
        q = params["model.layers.0.self_attn.q_proj.weight"]
        o = params["model.layers.0.self_attn.o_proj.weight"]
        want = ("S0", "S0") if tp > 1 else ("S0",)
        check(placements(q) == want, f"q_proj placements {placements(q)}, expected {want}")
        check(local_rows(q) * tp * shards == q.shape[0], f"q_proj local rows {local_rows(q)} of {q.shape[0]}")
        if tp > 1:
            check(placements(o) == ("S0", "S1"), f"o_proj placements {placements(o)}")
            check(o.to_local().shape[1] * tp == o.shape[1], f"o_proj local columns {o.to_local().shape}")
        plain = [n for n, p in params.items() if not hasattr(p, "placements")]
        check(not plain, f"parameters left plain: {plain[:3]}")

    return expect


def ulysses(layout: Any) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    check(ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward, "SDPA not routed through Ulysses")
    check(layout.describe["sp_size"] == 2, f"describe {layout.describe}")
    local = layout.shard_batch(batch("cpu", 8))
    check(local["input_ids"].shape[1] == SEQ // 2, f"sequence slice of {local['input_ids'].shape[1]} tokens")


def pipeline_two_stages(device: str, dtype: torch.dtype | None) -> str:
    """pp2's one-device equivalent: hftk's 2-stage cut on one rank, torch's interleaved schedule in between."""
    from transformers import Trainer

    from hftk.config.options import StrategyConfig, load_config
    from hftk.strategies import pipeline

    fake_group(1)
    model = small_llama().to(device)
    topo = pipeline.Topology(pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, pp_group=dist.group.WORLD,
                             dp_group=dist.group.WORLD, tie_group=None, device=torch.device(device))
    s = StrategyConfig(strategy="pipeline", pp_size=1, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                       pp_microbatches=2)
    rt = pipeline.build_runtime(model, s, topo, bf16=dtype is torch.bfloat16)
    check(rt.stage_indices == [0, 1] and [len(st.block_indices) for st in rt.stages] == [2, 2],
          f"stages {rt.stage_indices}, blocks {[st.block_indices for st in rt.stages]}")
    before = {n: p.detach().float().clone() for n, p in rt.params}
    args = load_config(["--learning_rate", str(OPTIM.learning_rate), "--weight_decay", "0"]).args
    optimizer_class, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)  # the Trainer's AdamW
    optimizer = optimizer_class([p for _, p in rt.params], **optimizer_kwargs)
    b = batch(device, model.config.vocab_size)
    labels = b["input_ids"].clone()
    tokens = torch.tensor(float(BATCH * (SEQ - 1)), device=device)
    # the model's own loss over each micro-batch divided by the step's token count: summed, the mean
    loss = float(pipeline.forward_backward(rt, {"input_ids": b["input_ids"], "labels": labels}, tokens))
    pipeline.reduce_gradients(rt)
    norm = float(pipeline.clip_gradients(rt, 1.0))
    optimizer.step()
    check(math.isfinite(loss) and loss > 0, f"loss {loss}")
    check(math.isfinite(norm) and norm > 0, f"grad norm {norm}")
    still = [n for n, p in rt.params if torch.equal(before[n], p.detach().float())]
    check(not still, f"{len(still)} parameters unchanged by the step, e.g. {still[:2]}")
    return f"loss {loss:.3f}, grad norm {norm:.3f} (2 stages on one rank: hand-off in memory, no P2P)"


LAYOUTS: dict[str, Callable[..., str]] = {
    "tp2 x fsdp2": mesh_layout("tp", 4, ["--tp_size", "2", "--dp_shard_size", "2"], sharded(tp=2, shards=2)),
    "cp2 x tp2": mesh_layout("cp", 4, ["--cp_size", "2", "--tp_size", "2", "--block_size", str(SEQ)],
                             sharded(tp=2, shards=2)),
    "sp2": mesh_layout("sp", 2, ["--sp_size", "2", "--block_size", str(SEQ)], ulysses),
    "pp2": pipeline_two_stages,
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    opts = parser.parse_args(argv)
    if opts.device == "cuda":
        torch.cuda.set_device(0)
    print(f"layouts on one {opts.device} device ({NOTE})")
    print("| layout | dtype | result | detail |\n|---|---|---|---|")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    failed = 0
    for name in opts.layouts.split(","):
        for dtype in opts.dtypes.split(","):
            ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa  # sp's Ulysses replaces it process-wide, on its own group
            try:
                detail, result = LAYOUTS[name](opts.device, DTYPES[dtype]), "pass"
            except Exception as exc:  # a row per failure, with its reason; the rest still run
                traceback.print_exc(file=sys.stderr)
                detail, result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", "FAIL"
                failed += 1
            print(f"| {name} | {dtype} | {result} | {detail} |", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
