"""Tensor-parallel plans (hftk/strategies/tp_plans.py) in one process: GPT-2's Conv1D -> nn.Linear
conversion keeps its outputs and maps back to the HF state dict exactly, and the replicated parameters
are the ones no plan splits (the multi-process proofs: tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import torch


def test_gpt2_linear_conversion_keeps_outputs_and_maps_back_exactly():
    import copy

    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model
    from hftk.strategies.tp_plans import FusedQKV, gpt2_to_linear, to_hf_state_dict

    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny")).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    converted = gpt2_to_linear(copy.deepcopy(model))
    assert isinstance(converted.transformer.h[0].attn.c_attn, FusedQKV)
    ids = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, converted(input_ids=ids).logits, atol=1e-6)
    back = to_hf_state_dict(converted.state_dict())
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_replicated_parameters_are_the_ones_no_plan_splits():
    from hftk.data.builtin import builtin_model_config
    from hftk.strategies.tp_plans import replicated_params

    # GPT-2 tiny (2 blocks, width 64, 256 positions): position table, 5 LayerNorms, 4 row-parallel biases
    assert replicated_params(builtin_model_config("builtin:gpt2-tiny")) == 256 * 64 + 5 * 2 * 64 + 4 * 64
    # Llama tiny (4 blocks, width 64): 9 RMSNorm weights; no biases
    assert replicated_params(builtin_model_config("builtin:llama-tiny")) == 9 * 64
