"""Loading: a chat template's markers added to the tokenizer (or not), and the model fitted to it: embeddings
grown by transformers' mean resizing, the same new rows on every rank, the EOS the model stops on."""

from __future__ import annotations

import torch

from hftk.config.options import ModelConfig
from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer

BUILTIN = ModelConfig(model_name_or_path="builtin:gpt2-tiny")


def test_load_tokenizer_adds_the_chat_markers_and_says_so_once(capsys):
    tokenizer = load_tokenizer(BUILTIN, "chatml", add_chat_tokens=True, announce=True)
    assert len(tokenizer) == 2050 and tokenizer.eos_token == "<|im_end|>"
    assert capsys.readouterr().out == ("hftk: chat template chatml: added <|im_start|>, <|im_end|> as special tokens; "
                                       "EOS is <|im_end|> (--no_add_chat_tokens keeps them as text)\n")
    quiet = load_tokenizer(BUILTIN, "chatml", add_chat_tokens=True)
    assert len(quiet) == 2050 and capsys.readouterr().out == ""


def test_no_add_chat_tokens_keeps_the_vocabulary_and_eos():
    plain = load_tokenizer(BUILTIN)
    kept = load_tokenizer(BUILTIN, "chatml", add_chat_tokens=False)
    assert (len(kept), kept.eos_token) == (len(plain), plain.eos_token) == (2048, "<|endoftext|>")
    model = load_model(BUILTIN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fit_to_tokenizer(model, kept, seed=0) == []
    assert model.get_input_embeddings().weight.shape[0] == 2048 and model.config.eos_token_id == kept.eos_token_id
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fit_to_tokenizer_grows_the_embeddings_as_transformers_does_with_the_same_rows_everywhere(tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = load_tokenizer(BUILTIN, "chatml")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    old = load_model(BUILTIN).get_input_embeddings().weight.detach().clone()

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    model = load_model(BUILTIN)
    assert fit_to_tokenizer(model, tokenizer, seed=7) == [2048, 2049]
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's own RNG stream is untouched
    weight = model.get_input_embeddings().weight
    assert weight.shape == (len(tokenizer), old.shape[1]) and model.get_output_embeddings().weight is weight
    assert torch.equal(weight[:old.shape[0]], old)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos

    reference = load_model(BUILTIN)  # transformers' own resize under the same seed: what every rank draws
    torch.manual_seed(7)
    reference.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    assert torch.equal(weight, reference.get_input_embeddings().weight)
    other_rank, other_seed = load_model(BUILTIN), load_model(BUILTIN)
    fit_to_tokenizer(other_rank, tokenizer, seed=7)
    fit_to_tokenizer(other_seed, tokenizer, seed=8)
    assert torch.equal(weight, other_rank.get_input_embeddings().weight)
    assert not torch.equal(weight[old.shape[0]:], other_seed.get_input_embeddings().weight[old.shape[0]:])

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert reloaded.config.eos_token_id == GenerationConfig.from_pretrained(tmp_path).eos_token_id == eos


def test_hub_kernels_stay_off_unless_asked(tmp_path):
    """transformers turns hub kernels on whenever `kernels` is installed, and on CUDA then fetches
    kernels-community layers at the first model.eval() (offline: the run fails after training)."""
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model

    path = materialize_model("builtin:gpt2-tiny")
    assert AutoModelForCausalLM.from_pretrained(path).use_kernels, "transformers' default changed: this test proves nothing"
    assert not load_model(ModelConfig(model_name_or_path="builtin:gpt2-tiny")).use_kernels
    assert load_model(ModelConfig(model_name_or_path="builtin:gpt2-tiny", use_hub_kernels=True)).use_kernels


def test_what_the_model_class_builds_frozen_stays_frozen_after_loading(tmp_path):
    """Ernie 4.5 MoE declares its routers' score-correction bias ``requires_grad=False`` (its own rule updates it);
    transformers' from_pretrained makes it trainable again, and under DDP the run then failed at its second step
    waiting for a gradient that never comes. hftk's loading keeps it frozen; everything else stays trainable."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import make_family

    folder = make_family("ernie4_5_moe", tmp_path / "ernie", moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                         moe_layer_start_index=0)
    bias = "model.layers.0.mlp.gate.moe_statics.e_score_correction_bias"
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert plain.get_parameter(bias).requires_grad, "transformers now keeps it frozen: this test proves nothing"
    model = load_model(ModelConfig(model_name_or_path=str(folder)))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in plain.named_parameters() if name.endswith("e_score_correction_bias")}
    assert bias in frozen
