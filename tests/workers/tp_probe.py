"""Probe tensor and sequence parallel on 2 ranks against one process; rank 0 writes a JSON report.

Tensor parallel, per family (Llama, GPT-2, GPT-NeoX from the built-ins; tiny Mistral and Qwen2
built from config): local shapes of the sharded weights, whether embedding and LM head are
vocabulary-sharded and still tied, and the largest logit difference from the unsharded model.

Sequence parallel (Ulysses, Llama): the model comes from ``from_pretrained`` in eval mode; hftk's
layout and train step must put it in train mode and give the single-process loss; an eval-mode
forward through hftk's registration must also give it, while accelerate's registration
(``disable_in_eval=True``) silently gives another loss.

Usage: torchrun --nproc_per_node 2 tests/workers/tp_probe.py OUT.json
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist


def tiny_from_config(kind: str):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    cls = {"mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    config = cls(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def load(name: str):
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model

    if name in ("mistral", "qwen2"):
        return tiny_from_config(name)
    return AutoModelForCausalLM.from_pretrained(materialize_model(f"builtin:{name}"))


def probe_tp(name: str, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    from hftk.strategies.tp_plans import apply_tensor_parallel

    model = load(name).eval()
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, 2048, (2, 32))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
    shapes = {}
    for pname, param in model.named_parameters():
        if isinstance(param, DTensor):
            shapes[pname] = {"local": list(param.to_local().shape), "full": list(param.shape),
                             "placements": [str(p) for p in param.placements]}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return {
        "max_logit_diff": float((logits.full_tensor() - expected).abs().max()),
        "logits_sharded_on_vocab": isinstance(logits, DTensor) and str(logits.placements[0]) == "S(2)",
        "local_logits_shape": list(logits.to_local().shape),
        "sharded": shapes,
        "n_params": len(list(model.named_parameters())),
        "tied": head.weight is embedding.weight,
        "was_tied": reference.get_output_embeddings().weight is reference.get_input_embeddings().weight,
    }


def probe_sp() -> dict:
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hftk.config.options import load_config
    from hftk.strategies import sequence
    from hftk.strategies.mesh import MeshStep, all_reduce_sum, loss_sum, token_count

    torch.manual_seed(2)
    ids = torch.randint(0, 2048, (2, 64))
    batch = {"input_ids": ids, "position_ids": torch.arange(64).expand_as(ids),
             "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100)}
    reference = load("llama-tiny")
    reference.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = float(loss_sum(reference, batch)) / float(token_count(batch))
    core_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    model = load("llama-tiny")  # from_pretrained: eval mode
    loaded_in_train_mode = model.training
    cfg = load_config(["--strategy", "sp", "--sp_size", "2", "--model_name_or_path", "builtin:llama-tiny"])
    layout = sequence.layout(model, cfg, "cpu")
    train_mode_after_layout = model.training

    def sp_loss() -> float:
        local = layout.shard_batch(batch)
        tokens = all_reduce_sum(token_count(local), layout.data_groups)
        with torch.no_grad():
            total = all_reduce_sum(loss_sum(model, local).double(), layout.data_groups)
        return float(total / tokens)

    model.eval()
    eval_mode_loss = sp_loss()

    # One real train step from eval mode, with a learning rate of 0 (the weights stay put).
    model.eval()
    step_loss = MeshStep(layout, torch.device("cpu")).forward_backward([{"input_ids": ids, "labels": ids}])
    train_mode_after_step = model.training

    # accelerate's registration of the same adapter: disable_in_eval=True.
    hftk_attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
    config = model.config
    accelerate_style = UlyssesSPAttentionHF(
        attn=core_sdpa, batch_size=2, attn_head_count=config.num_attention_heads,
        attn_head_size=config.hidden_size // config.num_attention_heads, kv_head_count=config.num_key_value_heads,
        num_hidden_layers=config.num_hidden_layers, process_group=dist.group.WORLD, seq_length_is_variable=True,
        disable_in_eval=True)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, *a, **kw: accelerate_style(
        module, q, k, v, None, *a, **kw)
    model.eval()
    trap_loss = sp_loss()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = hftk_attention
    return {
        "expected": expected, "eval_mode_loss": eval_mode_loss, "train_step_loss": step_loss,
        "accelerate_eval_mode_loss": trap_loss, "loaded_in_train_mode": loaded_in_train_mode,
        "train_mode_after_layout": train_mode_after_layout, "train_mode_after_step": train_mode_after_step,
    }


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    report = {"world_size": dist.get_world_size(), "tp": {}}
    for name in ("llama-tiny", "gpt2-tiny", "neox-tiny", "mistral", "qwen2"):
        report["tp"][name] = probe_tp(name, mesh)
    report["sp"] = probe_sp()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    main()
    exit_without_teardown(0)  # skips gloo's teardown abort
