"""Expert parallel (hftk/strategies/expert.py) in one process: what it refuses before any process group, and one
rank's share of an experts module with its LoRA adapters (torch's fake process group: this process is rank 1 of 2)
computing exactly what the whole module computes for the tokens routed to that rank's experts."""

from __future__ import annotations

import copy

import pytest
import torch

MOE = ["--model_name_or_path", "builtin:qwen3-moe-small"]  # 8 experts, top-2
LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]

ERRORS = [
    # (id, WORLD_SIZE, args, field named, words the message must contain)
    ("dense_model", 2, [*LLAMA, "--strategy", "ep"], "model.model_name_or_path", "has no experts"),
    ("ep_not_dividing_the_world", 3, [*MOE, "--strategy", "ep", "--ep_size", "2"], "strategy.ep_size",
     "does not divide the world size 3"),
    ("ep_not_dividing_the_experts", 3, [*MOE, "--strategy", "ep"], "strategy.ep_size",
     "does not divide the model's 8 experts per layer"),
    ("ep_size_needs_ep", 2, [*MOE, "--strategy", "fsdp", "--ep_size", "2"], "strategy.ep_size", "--strategy ep"),
    ("with_tp", 2, [*MOE, "--strategy", "ep", "--tp_size", "2"], "strategy.tp_size", "strategy ep does not use it"),
    ("cpu_offload", 2, [*MOE, "--strategy", "ep", "--fsdp_cpu_offload"], "strategy.fsdp_cpu_offload", "strategy ep"),
    ("quantized_base", 2, [*MOE, "--strategy", "ep", "--lora_r", "4", "--load_in_4bit"], "model.load_in_4bit",
     "expert parallel"),
    ("sync_check", 2, [*MOE, "--strategy", "ep", "--check_sync_steps", "1"], "tracking.check_sync_steps",
     "no replicas"),
]


@pytest.mark.parametrize("case_id,world,args,field,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_expert_parallel_runs_fail_in_one_line_before_any_process_group(case_id, world, args, field, words,
                                                                            tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from hftk.run.prepare import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "out"
    assert main(["--output_dir", str(out), *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hftk: error: {field}:") and words in lines[0] and "Fix:" in lines[0], lines[0]
    assert not dist.is_initialized() and not out.exists()


def test_one_ranks_experts_and_their_adapters_compute_what_the_whole_module_does(tmp_path):
    """Rank 1 of 2 keeps experts 4-7 of 8 with their LoRA adapters (lora_A's rows, lora_B's interleaved columns
    through its local view) and runs them on local tensors: for tokens routed there (local ids 0-3) the output and
    every gradient equal the whole adapted module's on the same tokens (global ids 4-7)."""
    import torch.distributed as dist
    from peft import get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from hftk.config.options import ModelConfig
    from hftk.data.builtin import materialize_model
    from hftk.models.lora import lora_config
    from hftk.strategies.expert import experts_core, run_on_local_tensors, shard_experts

    folder = materialize_model("builtin:qwen3-moe-small")
    base = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="grouped_mm")
    torch.manual_seed(0)
    model = get_peft_model(base, lora_config(ModelConfig(lora_r=4, lora_dropout=0.0), base.config))
    whole = model.base_model.model.model.layers[0].mlp.experts
    for name, param in whole.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param, std=0.1)  # lora_B starts at zero: give every column a value
    mine = copy.deepcopy(whole)
    tokens = torch.randn(6, 128, requires_grad=True)
    chosen = torch.tensor([[4, 7], [5, 6], [7, 4], [6, 5], [4, 5], [6, 7]])
    weights = torch.rand(6, 2)
    want = whole(tokens, chosen, weights)
    want.square().sum().backward()

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        core, views = shard_experts(mine, init_device_mesh("cpu", (2,)))
        run_on_local_tensors(mine, views)
        local_tokens = tokens.detach().clone().requires_grad_(True)
        got = mine(local_tokens, chosen - 4, weights)
        got.square().sum().backward()
        assert core.num_experts == 4 and torch.allclose(got, want, atol=1e-6)
        assert torch.allclose(local_tokens.grad, tokens.grad, atol=1e-6)
        _, wrappers = experts_core(whole)
        _, mine_wrappers = experts_core(mine)
        for full, part in zip(wrappers, mine_wrappers):
            a, b = full.lora_A["default"].weight, full.lora_B["default"].weight
            a_part, b_part = part.lora_A["default"].weight, part.lora_B["default"].weight
            assert a_part.to_local().shape[0] == 4 * 4 and b_part.to_local().shape == b.shape  # r rows per expert
            assert torch.allclose(a_part.grad.to_local(), a.grad[4 * 4:], atol=1e-6)  # this rank's experts' rows
            b_grad = b_part.grad.to_local().reshape(b.shape[0], 4, 8)  # columns: rank x expert
            assert torch.allclose(b_grad[:, :, 4:], b.grad.reshape(b.shape[0], 4, 8)[:, :, 4:], atol=1e-6)
            assert not b_grad[:, :, :4].any()  # the other rank's columns: its share, summed over the group later
        # every weight back where it was (PEFT's parametrization leaves a buffer of its name behind when it goes)
        assert not [n for m in mine.modules() for n in m._buffers if n in ("gate_up_proj", "down_proj")]
        assert all(type(p).__name__ == "DTensor" for n, p in core.named_parameters())
    finally:
        dist.destroy_process_group()
