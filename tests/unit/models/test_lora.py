"""LoRA and QLoRA options in one process (hftk.models.lora): the default targets of every family, bad LoRA and
quantization options refused by name, paged optimizers refused without a GPU."""

from __future__ import annotations

import pytest
import torch

from hftk.core.errors import HftkError
from hftk.models.support_table import MATRIX_FAMILIES
from tests.helpers import TINY_ARGS


@pytest.mark.parametrize("model_type", MATRIX_FAMILIES)
def test_default_targets_wrap_what_peft_all_linear_wraps(model_type):
    """The default targets (the spec's, by name) adapt exactly the modules PEFT's own ``all-linear`` picks: every
    linear projection of every block, attention and MLP, the LM head left out; of a mixture of experts, the router
    left out (where tokens go is not what an adapter should learn) and the fused expert weights added."""
    from peft import LoraConfig, get_peft_model

    from hftk.config.options import ModelConfig
    from hftk.models.lora import check_targets, lora_config, uses_conv1d
    from hftk.models.spec import model_spec
    from tests.unit.models.test_layout import tiny

    cfg = ModelConfig(lora_r=4)
    model = tiny(model_type)
    check_targets(cfg, model.config)
    moe = model_spec(model.config).moe
    ours = get_peft_model(tiny(model_type), lora_config(cfg, model.config, conv1d=uses_conv1d(model)))
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", fan_in_fan_out=uses_conv1d(model)))
    adapted = [{n for n, m in m_.named_modules() if hasattr(m, "lora_A")} for m_ in (ours, peft)]
    if moe is not None:  # PEFT's all-linear takes fused experts in too (as target_parameters), and some routers
        def sparse(names: set[str]) -> set[str]:
            return {n for n in names if n.endswith("." + moe.router) or f".{moe.experts}" in n}

        assert any(f".{moe.experts}" in n for n in adapted[0]), "the experts' fused weights are adapted"
        assert not any(n.endswith("." + moe.router) for n in adapted[0]), "routers are not"
        adapted = [names - sparse(names) for names in adapted]
    assert adapted[0] == adapted[1]
    per_block = sum(1 for n in adapted[0] if ".0." in n)
    assert per_block >= 4  # attention and MLP both adapted


ERRORS = [
    ("lora_with_tp", ["--model_name_or_path", "builtin:llama-tiny", "--strategy", "tp", "--tp_size", "2",
                      "--lora_r", "8"], "model.lora_r", "zero3_offload, ep, pipeline"),
    ("lora_with_sp", ["--model_name_or_path", "builtin:llama-tiny", "--strategy", "sp", "--sp_size", "2",
                      "--lora_r", "8"], "model.lora_r", "strategy sp"),
    ("target_not_in_model", ["--lora_r", "8", "--lora_target_modules", "c_attn,q_proj"], "model.lora_target_modules",
     "q_proj match(es) no module of gpt2"),
    ("target_not_linear", ["--lora_r", "8", "--lora_target_modules", "ln_1"], "model.lora_target_modules",
     "cannot wrap ln_1 (LayerNorm)"),
    ("negative_rank", ["--lora_r", "-1"], "model.lora_r", "must be >= 0"),
    ("zero_alpha", ["--lora_r", "8", "--lora_alpha", "0"], "model.lora_alpha", "must be > 0"),
    ("dropout_one", ["--lora_r", "8", "--lora_dropout", "1.0"], "model.lora_dropout", "[0, 1)"),
    ("targets_without_rank", ["--lora_target_modules", "c_attn"], "model.lora_target_modules", "lora_r is 0"),
    ("merged_push_without_lora", ["--hub_push_merged"], "hub.hub_push_merged", "lora_r is 0"),
]


@pytest.mark.parametrize("case_id,args,field,words", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_lora_options_are_one_clear_line(case_id, args, field, words, tmp_path, capsys):
    import torch.distributed as dist

    from hftk.run.prepare import main

    out = tmp_path / "out"
    assert main([*TINY_ARGS, "--output_dir", str(out), *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hftk: error: {field}:") and words in lines[0], lines
    assert "Fix:" in lines[0] and not dist.is_initialized() and not out.exists()


def refusal(args: list[str], monkeypatch) -> HftkError:
    from hftk.run.prepare import prepare

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(HftkError) as err:
        prepare([*TINY_ARGS, *args])
    return err.value


@pytest.mark.parametrize("args,field,words", [
    (["--load_in_4bit"], "model.load_in_4bit", "cannot be fully fine-tuned"),
    (["--load_in_8bit"], "model.load_in_8bit", "cannot be fully fine-tuned"),
    (["--use_dora"], "model.use_dora", "lora_r is 0"),
    (["--lora_r", "8", "--load_in_4bit", "--load_in_8bit"], "model.load_in_8bit", "both set"),
    (["--lora_r", "8", "--load_in_4bit", "--strategy", "zero3"], "model.load_in_4bit", "ZeRO-3"),
    (["--lora_r", "8", "--load_in_8bit", "--strategy", "zero2"], "model.load_in_8bit", "ZeRO-1/2"),
    (["--lora_r", "8", "--load_in_4bit", "--strategy", "pipeline"], "model.load_in_4bit", "pipeline"),
    (["--lora_r", "8", "--load_in_4bit", "--strategy", "tp"], "model.lora_r", "tp"),
    (["--lora_r", "8", "--load_in_8bit", "--strategy", "fsdp"], "model.load_in_8bit", "int8"),
])
def test_bad_quantization_options_are_refused_by_name(args, field, words, monkeypatch, tmp_path):
    err = refusal([*args, "--output_dir", str(tmp_path)], monkeypatch)
    assert err.field == field and words in err.problem, (err.field, err.problem)


@pytest.mark.skipif(torch.cuda.is_available(), reason="paged optimizers run on a GPU")
def test_paged_optimizer_is_refused_without_a_gpu(monkeypatch, tmp_path):
    err = refusal(["--optim", "paged_adamw_8bit", "--output_dir", str(tmp_path)], monkeypatch)
    assert err.field == "training.optim" and "adamw_8bit" in err.fix


@pytest.mark.parametrize("name,family", [("builtin:gpt2-tiny", "gpt2"), ("builtin:llama-tiny", "llama")])
def test_added_chat_tokens_train_with_the_adapter_and_reload_and_merge_as_trained(name, family, tmp_path):
    """Chat markers added to the vocabulary: PEFT's trainable tokens train their rows (GPT-2's tied head follows
    the embedding, Llama's untied head trains its own new rows), hftk's adapter file holds them (and the grown
    embeddings, as PEFT's own save does), and PEFT's reload on the grown base and hftk's merge give the trained
    model's logits."""
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hftk.config.options import ModelConfig
    from hftk.models import lora
    from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer, resolve_model_path

    cfg = ModelConfig(model_name_or_path=name, lora_r=4)
    tokenizer = load_tokenizer(cfg, "chatml")
    model = load_model(cfg)
    new = fit_to_tokenizer(model, tokenizer, seed=0)
    torch.manual_seed(0)
    peft = get_peft_model(model, lora.lora_config(cfg, model.config, lora.trainable_tokens(model, new),
                                                  lora.uses_conv1d(model)))
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    deltas = {n.split(".token_adapter")[0].rsplit(".", 1)[-1] for n in trainable if "trainable_tokens_delta" in n}
    assert deltas == ({"wte"} if family == "gpt2" else {"embed_tokens", "lm_head"})
    with torch.no_grad():  # "trained": every trainable tensor moved
        for n, p in peft.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.tensor([tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]])
    assert ids.max() == 2049
    peft.eval()
    want = peft(ids).logits

    folder = tmp_path / "adapter"
    lora.write_adapter(folder, peft.peft_config[lora.ADAPTER_NAME], lora.adapter_tensors(peft), lora.adapter_shapes(peft))
    tokenizer.save_pretrained(folder)
    saved = load_file(str(folder / lora.ADAPTER_WEIGHTS))
    peft_keys = set(get_peft_model_state_dict(peft))
    assert set(saved) <= peft_keys and {k for k in peft_keys if "wte" in k or "embed_tokens" in k} <= set(saved)
    if family == "llama":  # the untied head's new rows and the grown head itself (a tied one is the embedding)
        assert {k for k in peft_keys if "lm_head" in k} <= set(saved)
    assert any(k.endswith("trainable_tokens_delta") for k in saved)

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg))
    fit_to_tokenizer(base, tokenizer, seed=123)  # other new rows: the saved ones replace them
    reloaded = PeftModel.from_pretrained(base, str(folder)).eval()
    torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=1e-5)
    merged = lora.merged_model(folder, resolve_model_path(cfg)).eval()
    assert merged.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert merged.config.eos_token_id == tokenizer.eos_token_id == 2049
    torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
