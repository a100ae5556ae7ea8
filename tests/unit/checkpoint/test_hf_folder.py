"""The HF folder layer (hftk.checkpoint.hf_folder): a DCP model folder is read whole in one process."""

from __future__ import annotations

import torch


def test_a_dcp_model_folder_is_read_whole_in_one_process(tmp_path):
    """``hftk export``'s reader of fsdp and mesh checkpoints: the model entries only, named as the model names them."""
    import torch.distributed.checkpoint as dcp

    from hftk.checkpoint.hf_folder import read_dcp_model

    model = {"model.layers.0.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(5, 3)}  # llama-like names
    dcp.save({"model": model, "optim": {"step": torch.tensor(3.0)}}, checkpoint_id=tmp_path, no_dist=True)
    got = read_dcp_model(tmp_path)
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], v) for k, v in model.items())


# ---- check_complete: the folder against what save_pretrained writes for the live model

import pytest  # noqa: E402

from hftk.core.errors import HftkError  # noqa: E402

EXPERTS = {"qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8},
           "mixtral": {"num_local_experts": 4}}


def tiny(model_type: str, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, **sizes)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def saved_shapes(folder) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("model_type", sorted(EXPERTS))
def test_fused_experts_written_back_per_expert_pass_the_check(model_type, tmp_path):
    """transformers 5 holds the experts fused ([E, 2I, H]) and save_pretrained writes them under the original
    per-expert names (Mixtral: renamed to block_sparse_moe.experts.{e}.w1 / w3 / w2 too): the check expects that."""
    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    model = tiny(model_type, **EXPERTS[model_type])
    assert any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())
    model.save_pretrained(tmp_path)
    saved = saved_shapes(tmp_path)
    assert not any("gate_up_proj" in k for k in saved) and sum(".experts.3." in k for k in saved) == 3, sorted(saved)
    expected = shapes_of(model)
    assert {names[0]: shape for names, shape in expected} == saved  # every tensor written, nothing else expected
    check_complete(tmp_path, expected)


@pytest.mark.parametrize("damage", ["missing", "misshapen"])
def test_an_expert_missing_or_cut_short_is_named(damage, tmp_path):
    from safetensors.torch import load_file, save_file

    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    model = tiny("qwen3_moe", **EXPERTS["qwen3_moe"])
    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    if damage == "missing":
        del state[name]
    else:
        state[name] = state[name][:-1].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HftkError, match=rf"lacks {name.replace('.', '[.]')} \[16, 32\]"):
        check_complete(tmp_path, shapes_of(model))


def test_a_folder_in_the_live_names_is_checked_as_such(tmp_path):
    """FSDP's checkpoint model file keeps the live names (save_original_format=False): the check is told so."""
    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    model = tiny("qwen3_moe", **EXPERTS["qwen3_moe"])
    model.save_pretrained(tmp_path, save_original_format=False)
    check_complete(tmp_path, shapes_of(model, original_format=False))
    with pytest.raises(HftkError, match=r"lacks model[.]layers[.]0[.]mlp[.]experts[.]0[.]"):
        check_complete(tmp_path, shapes_of(model))


def test_a_tied_head_is_found_under_the_name_kept_and_a_missing_one_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    model = tiny("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in saved_shapes(tmp_path)  # saved once, as the embedding
    check_complete(tmp_path, shapes_of(model))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.embed_tokens.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HftkError, match=r"lacks model[.]embed_tokens[.]weight \[64, 32\]"):
        check_complete(tmp_path, shapes_of(model))
