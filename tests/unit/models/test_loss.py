"""The chunked causal-LM loss (hftk/models/loss.py) against the model's own: every family the support matrix claims,
MoE balancing loss, soft-capping and logit scales, masked labels, the Trainer's token count, adapters on the head."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hftk.models.support_table import MATRIX_FAMILIES
from hftk.models import loss as causal_loss
from tests.helpers import SIZES, make_family

TOL = 1e-5


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of 24 tokens, a prompt masked with -100 on the first, the Trainer's count of targets given."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "num_items_in_batch": torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)}  # as if summed over ranks


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks (GPT-2 ships with dropout)
    out = model(**batch)
    out.loss.backward()
    return float(out.loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = 5) -> None:
    model.train()
    plain = copy.deepcopy(model)
    want, want_grads = _loss_and_grads(plain, batch)
    causal_loss.install(model, chunk=chunk)
    got, got_grads = _loss_and_grads(model, batch)
    assert got == pytest.approx(want, rel=TOL), (got, want)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=TOL, atol=1e-7), name
    model.eval()
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(float(plain.eval()(**batch).loss), rel=TOL)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss-families")
    return {f: make_family(f, root / f) for f in MATRIX_FAMILIES}


@pytest.mark.parametrize("family", MATRIX_FAMILIES)
def test_chunked_loss_and_gradients_equal_the_models_own(family, families):
    """Loss, every gradient and the eval loss within 1e-5 of the model's own forward, the balancing loss of the
    mixtures included (their router logits on while training, as hftk.models.moe turns them on)."""
    model = AutoModelForCausalLM.from_pretrained(families[family])
    batch = _batch(model.config.vocab_size)
    if getattr(model.config, "output_router_logits", None) is not None:
        batch["output_router_logits"] = True
        model.router_aux_loss_coef = 0.25  # what hftk trains with: not the config's
    _assert_same(model, batch)


@pytest.mark.parametrize("family,fields", [("gemma3_text", {"final_logit_softcapping": 5.0}),
                                           ("cohere", {"logit_scale": 0.125}), ("granite", {"logits_scaling": 4.0})])
def test_the_familys_logit_transform_is_read_from_its_config(family, fields):
    config = AutoConfig.for_model(family, vocab_size=97, **SIZES, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    _assert_same(model, _batch(97))


def test_an_adapter_on_the_head_trains_through_the_chunked_loss():
    """LoRA on lm_head (and q_proj): the head's adapter gets the plain loss's gradient, not none."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=97, **SIZES))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    want_loss, want = _loss_and_grads(copy.deepcopy(model).train(), _batch(97))
    causal_loss.install(model, chunk=7)
    got_loss, got = _loss_and_grads(model.train(), _batch(97))
    assert got_loss == pytest.approx(want_loss, rel=TOL)
    assert any("lm_head.lora" in n for n in got)
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=TOL, atol=1e-7), name


def test_a_batch_without_targets_is_a_connected_zero():
    """Every label masked: loss 0 with a gradient path to the head (DDP waits for every parameter's gradient)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=97, **SIZES))
    causal_loss.install(model)
    batch = _batch(97)
    batch["labels"][:] = -100
    out = model(**batch)
    out.loss.backward()
    assert float(out.loss) == 0.0 and model.lm_head.weight.grad is not None


def test_generation_runs_the_models_own_forward():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=97, **SIZES)).eval()
    ids = torch.tensor([[1, 2, 3]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    causal_loss.install(model)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    assert model(ids).logits.shape == (1, 3, 97)


def test_chunks_hold_a_bounded_number_of_logits():
    assert causal_loss.chunk_tokens(151_936) * 151_936 <= causal_loss.CHUNK_ELEMENTS
    assert causal_loss.chunk_tokens(10) == causal_loss.CHUNK_ELEMENTS // 10
    assert causal_loss.choose("auto", "trainer") == "chunked" and causal_loss.choose("auto", "loop") == "plain"
