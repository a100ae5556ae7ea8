"""Packing that keeps examples apart (``data.packing bfd``), dynamic padding (``none``), and where each
strategy stands (``hftk.support.PACKING_SUPPORT``).

The exactness checks run in-process on small models of every family made from their default configs
(``tests.integration.test_matrix.make_family``): the logits of an example packed among others by best-fit
decreasing equal those of the same example run alone, and the packed loss equals the token-weighted
mean of the examples' own losses.
"""

from __future__ import annotations

import pytest
import torch

from hftk.chat import IGNORE_INDEX
from hftk.config import DataConfig
from hftk.data import collator, rows
from tests.integration.test_matrix import make_family

FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox", "mistral")
LENGTHS = (5, 31, 12, 3, 20, 9, 17, 2, 26, 8)  # whole examples, block 32: several share a block


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_family(f, root / f) for f in FAMILIES}


def examples(vocab: int, prompt: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * min(prompt, n - 1) + ids[min(prompt, n - 1):]})
    return out


def dataset(items: list[dict[str, list[int]]]):
    import datasets

    return datasets.Dataset.from_list(items)


def alone(model, ex: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits, summed loss and labelled-token count of one example run by itself (no padding, no mask)."""
    ids = torch.tensor([ex["input_ids"]])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    labels = torch.tensor(ex["labels"][1:])
    loss = torch.nn.functional.cross_entropy(logits[:-1], labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return logits, loss, int((labels != IGNORE_INDEX).sum())


def packed(vocab: int, attention: str | None = None, fixed_length: int | None = None
           ) -> tuple[list[dict[str, list[int]]], dict[str, torch.Tensor]]:
    """The examples (every token labelled: an example's first label must be dropped) and one bfd batch of
    all of them, as ``hftk.data.collator`` builds it for that attention / fixed length."""
    items = examples(vocab)
    cfg = DataConfig(packing="bfd", block_size=32)
    rows_ = rows(dataset(items), "bfd", 32, "prompt_completion")
    assert len(rows_) < len(items) and all(len(r) <= 32 for r in rows_["input_ids"])
    assert sorted(n for r in rows_["seq_lengths"] for n in r) == sorted(LENGTHS)  # every example whole
    batch = collator(cfg, pad_id=0, fixed_length=fixed_length, attention=attention)([rows_[i] for i in range(len(rows_))])
    assert "attention_mask" not in batch
    return items, batch


def assert_examples_apart(model, items: list[dict[str, list[int]]], batch: dict[str, torch.Tensor],
                          logits: torch.Tensor, loss: float | None = None) -> None:
    """Each example's slice of the packed ``logits`` equals ``model`` run on it alone (1e-5), pad tokens are
    segments of one with no label, and ``loss`` (when given) is the token mean of the examples' own losses."""
    by_ids = {tuple(e["input_ids"]): e for e in items}
    total, count, seen = 0.0, 0, 0
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        for start, end in zip(starts, starts[1:]):
            ex = by_ids.get(tuple(batch["input_ids"][row, start:end].tolist()))
            if ex is None:  # a pad token: its own segment, nothing learned from it
                assert end - start == 1 and batch["labels"][row, start] == IGNORE_INDEX
                continue
            alone_logits, alone_loss, n = alone(model, ex)
            torch.testing.assert_close(logits[row, start:end], alone_logits, atol=1e-5, rtol=0)
            total, count, seen = total + alone_loss, count + n, seen + 1
    assert seen == len(items)
    assert count == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # no label predicts a next example
    if loss is not None:
        assert loss == pytest.approx(total.item() / count, abs=1e-5)


# sdpa for every family; eager where the attention code differs most (GPT-2's own, Llama's shared one).
# Two layouts: the packed rows kept apart (sdpa / eager) and flattened into one row (what flash
# attention's varlen path needs; sdpa reads the same position ids there too).
@pytest.mark.parametrize("layout", ["rows", "flat"])
@pytest.mark.parametrize("family,attn", [*((f, "sdpa") for f in FAMILIES), ("gpt2", "eager"), ("llama", "eager")])
def test_bfd_example_equals_the_example_alone(models, family, attn, layout):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models[family], attn_implementation=attn).eval()
    items, batch = packed(model.config.vocab_size, "flash_attention_2" if layout == "flat" else attn)
    if layout == "flat":
        assert batch["input_ids"].shape == (1, sum(LENGTHS))  # one padding-free row
    else:
        assert batch["input_ids"].shape[0] > 1 and batch["input_ids"].shape[1] <= 32  # rows apart, not flattened
    with torch.no_grad():
        out = model(**batch)  # eval mode: without use_cache=False a cache would join the examples
    assert_examples_apart(model, items, batch, out.logits, out.loss.item())


@pytest.mark.parametrize("family,attn", [*((f, "sdpa") for f in FAMILIES), ("gpt2", "eager"), ("llama", "eager")])
def test_bfd_example_through_pipeline_stages_equals_the_example_alone(models, family, attn):
    """The pipeline engine's path, in one process: its collator (rows of block_size), the batch's inputs as
    ``_schedule_inputs`` hands them to every stage, and the stages run one after another. Each stage
    must build the packed mask from the travelling position ids (fails when they restart at 0 per stage)."""
    from transformers import AutoModelForCausalLM

    from hftk.strategies.pipeline import _pad_rows, build_stages

    model = AutoModelForCausalLM.from_pretrained(models[family], attn_implementation=attn).eval()
    items, batch = packed(model.config.vocab_size, fixed_length=32)
    batch = _pad_rows(batch, batch["input_ids"].shape[0] + 1)  # as a short batch is filled up to micro-batches
    assert batch["input_ids"].shape[1] == 32 and set(batch) == {"input_ids", "labels", "position_ids"}
    hidden = batch["input_ids"]
    with torch.no_grad():
        for stage in build_stages(model, 2):
            hidden = stage(hidden, position_ids=batch["position_ids"])
    assert_examples_apart(model, items, {k: v[:-1] for k, v in batch.items()}, hidden[:-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_bfd_example_through_the_mesh_step_batch_equals_the_example_alone(models, family):
    """The mesh strategies' path (tp / cp / sp), in one process on the plain model (tp 1): their batch from
    the collator at block_size and their ``loss_sum``. The position ids must be the collator's (fails with 0.. per
    row); 2 ranks of tp then give this loop's losses (the slow test below)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from hftk.strategies.mesh import loss_sum, model_batch, token_count

    model = AutoModelForCausalLM.from_pretrained(models[family]).eval()
    items = examples(model.config.vocab_size)
    rows_ = rows(dataset(items), "bfd", 32, "prompt_completion")
    collate = collator(DataConfig(packing="bfd", block_size=32), pad_id=0, fixed_length=32)
    batch = model_batch(collate([rows_[i] for i in range(len(rows_))]), "cpu")
    assert set(batch) == {"input_ids", "position_ids", "shift_labels"} and batch["input_ids"].shape[1] == 32
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = float(loss_sum(model, batch) / token_count(batch))
    labels = F.pad(batch["shift_labels"][:, :-1], (1, 0), value=IGNORE_INDEX)
    assert_examples_apart(model, items, {**batch, "labels": labels}, logits, loss)


def test_dynamic_padding_gives_the_block_padded_loss_on_fewer_tokens(models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    items = examples(model.config.vocab_size, prompt=2)
    per_row = rows(dataset(items), "none", 32, "prompt_completion")
    cfg = DataConfig(packing="none", block_size=32, pad_to_multiple_of=8)
    losses, tokens = {}, {}
    for name, collate in {"dynamic": collator(cfg, pad_id=0), "block": collator(cfg, pad_id=0, fixed_length=32)}.items():
        total = count = computed = 0
        for start in range(0, len(per_row), 4):  # batches of 4: lengths 5..31
            batch = collate([per_row[i] for i in range(start, min(start + 4, len(per_row)))])
            n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            with torch.no_grad():
                total, count = total + model(**batch).loss.item() * n, count + n
            computed += batch["input_ids"].numel()
            assert batch["input_ids"].shape[1] % 8 == 0
        losses[name], tokens[name] = total / count, computed
    assert losses["dynamic"] == pytest.approx(losses["block"], abs=1e-6)
    assert tokens["dynamic"] < tokens["block"] == 32 * len(LENGTHS)


def chat_data(tmp_path) -> str:
    import json

    rows_ = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes." * i}]}
             for i in range(1, 9)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return str(path)


CHAT = ["--model_name_or_path", "builtin:gpt2-tiny", "--chat_template", "chatml", "--block_size", "128",
        "--eval_fraction", "0"]


@pytest.mark.parametrize("args,packing", [
    ([], "bfd"),  # conversations under a Trainer strategy
    (["--strategy", "pipeline", "--pp_size", "2"], "bfd"),  # the stages build the packed mask
    (["--strategy", "pipeline", "--pp_size", "2", "--attn_implementation", "flash_attention_2"], "none"),
    (["--strategy", "sp", "--sp_size", "2", "--model_name_or_path", "builtin:llama-tiny"], "none"),
    (["--packing", "none", "--pad_to_multiple_of", "8"], "none"),
])
def test_auto_packing_resolves_by_format_and_strategy(tmp_path, monkeypatch, args, packing):
    from hftk.run import prepare
    from tests.integration.test_matrix import TWO_RANKS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    p = prepare([*CHAT, "--dataset", chat_data(tmp_path), *args, "--output_dir", str(tmp_path / "o")])
    assert p.cfg.data.packing == packing and all(s.cfg.packing == packing for s in p.sources)
    text = prepare(["--model_name_or_path", "builtin:gpt2-tiny", "--output_dir", str(tmp_path / "t")])
    assert text.cfg.data.packing == "concat"


@pytest.mark.parametrize("args,field,words", [
    (["--strategy", "pipeline", "--pp_size", "2", "--packing", "bfd", "--attn_implementation", "flash_attention_2"],
     "model.attn_implementation", "strategy pipeline (its batches are rows of block_size)"),
    (["--strategy", "tp", "--tp_size", "2", "--packing", "bfd", "--attn_implementation", "flash_attention_2"],
     "model.attn_implementation", "strategy tp"),
    (["--strategy", "sp", "--sp_size", "2", "--packing", "bfd"], "data.packing", "Ulysses attention"),
    (["--strategy", "cp", "--cp_size", "2", "--packing", "bfd"], "data.packing", "ring attention"),
    (["--packing", "bfd", "--attn_implementation", "flex_attention"], "model.attn_implementation", "flex_attention"),
    (["--packing", "concat"], "data.packing", "attends to the one before"),
    (["--packing", "none", "--pad_to_multiple_of", "0"], "data.pad_to_multiple_of", "between 1 and data.block_size"),
])
def test_packing_a_strategy_cannot_honour_is_refused_before_launch(tmp_path, monkeypatch, args, field, words):
    from hftk.errors import HftkError
    from hftk.run import prepare
    from tests.integration.test_matrix import TWO_RANKS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    model = ["--model_name_or_path", "builtin:llama-tiny"] if "--strategy" in args and args[1] in ("sp", "cp", "tp") else []
    with pytest.raises(HftkError) as err:
        prepare([*CHAT, *model, "--dataset", chat_data(tmp_path), *args, "--output_dir", str(tmp_path / "o")])
    assert err.value.field == field and words in err.value.problem


def varied_conversations(path, n: int = 48) -> str:
    """Conversations of 20..~230 tokens (gpt2-tiny's tokenizer): bfd puts several in one block."""
    import json

    rows_ = [{"messages": [{"role": "user", "content": f"Say {i}: " + "and the light " * (i * 7 % 23)},
                           {"role": "assistant", "content": "It was good. " * (1 + i * 5 % 13)}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bfd_trains_on_two_ranks_with_one_process_losses_and_every_packing_resumes_exactly(tmp_path):
    """Every Trainer engine family (DDP, FSDP2, ZeRO-3, LoRA under DDP) under bfd on 2 gloo ranks
    gives the per-step losses of one process (2 x 2 packed rows = 4 rows per step either way, 4 steps
    inside the first epoch: an epoch's short last batch is filled with repeated rows on 2 ranks). For
    each packing mode (bfd and none on conversations, concat on plain text), a run resumed from its
    step-2 checkpoint logs the uninterrupted run's steps 3-4 and ends on its final weights (the packed
    order is part of the data position). One 2-rank launch runs every cell (``finetune_cells``)."""
    from tests.helpers import finetune, finetune_cells, load_weights, losses, max_weight_diff, metrics

    data = varied_conversations(tmp_path / "chat.jsonl", n=64)
    steps = ["--eval_fraction", "0", "--max_steps", "4", "--max_train_samples", "64",
             "--per_device_train_batch_size", "2"]
    chat = ["--chat_template", "chatml", "--dataset", data, "--block_size", "256", *steps]
    common = [*chat, "--packing", "bfd"]
    lora = ["--lora_r", "8", "--adam_epsilon", "1e-4"]
    for name, extra in {"single": [], "lora_single": lora}.items():
        finetune(1, [*common, *extra, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / name)])
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    modes = {"bfd": common, "none": [*chat, "--packing", "none"], "concat": [*steps, "--packing", "concat"]}
    cells = {"fsdp": [*common, "--strategy", "fsdp"], "zero3": [*common, "--strategy", "zero3"],
             "lora_ddp": [*common, *lora]}
    for mode, args in modes.items():  # the uninterrupted run first: its checkpoint-2 is the resumed run's start
        cells[mode] = [*args, *save]
        cells[f"{mode}_resumed"] = [*args, "--resume_from_checkpoint", str(tmp_path / mode / "checkpoint-2")]
    finetune_cells(2, {name: [*args, "--output_dir", str(tmp_path / name)] for name, args in cells.items()},
                   tmp_path, timeout=1100)
    assert max(m["epoch"] for m in metrics(tmp_path / "single") if "loss" in m) <= 1  # 4 steps in one epoch
    single, lora_single = losses(tmp_path / "single"), losses(tmp_path / "lora_single")
    assert len(single) == 4
    for name in ("bfd", "fsdp", "zero3", "lora_ddp"):
        ref = lora_single if name.startswith("lora") else single
        got = losses(tmp_path / name)
        assert got.keys() == ref.keys() and all(abs(got[s] - ref[s]) < 1e-5 for s in ref), (name, got, ref)
    for mode in modes:
        resumed, uninterrupted = losses(tmp_path / f"{mode}_resumed"), losses(tmp_path / mode)
        assert sorted(resumed) == [3, 4], (mode, resumed)
        assert all(resumed[s] == pytest.approx(uninterrupted[s], abs=1e-6) for s in resumed), \
            (mode, resumed, uninterrupted)
        diff = max_weight_diff(load_weights(tmp_path / mode / "final"),
                               load_weights(tmp_path / f"{mode}_resumed" / "final"))
        assert diff < 1e-6, f"{mode}: resumed final weights differ from the uninterrupted run's by {diff}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bfd_under_pipeline_and_tp_trains_like_one_process_and_resumes_exactly(tmp_path):
    """bfd through the engines the Trainer cannot drive, on 2 gloo ranks: a 2-stage pipeline (GPT-2, 2
    micro-batches) logs the per-step losses of a one-process Trainer bfd run (same sampler: the loop's is
    the Trainer's), tp 2 (Llama, the mesh loop) those of the mesh loop on one process; each resumed from
    its step-2 checkpoint logs the uninterrupted steps 3-4. Launches shared per engine (finetune_cells)."""
    from tests.helpers import finetune_cells, losses

    data = varied_conversations(tmp_path / "chat.jsonl", n=64)
    common = ["--chat_template", "chatml", "--dataset", data, "--block_size", "256", "--packing", "bfd",
              "--eval_fraction", "0", "--max_steps", "4", "--max_train_samples", "64",
              "--per_device_train_batch_size", "4"]
    gpt2, llama = ["--model_name_or_path", "builtin:gpt2-tiny4"], ["--model_name_or_path", "builtin:llama-tiny"]
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    out = {name: str(tmp_path / name) for name in ("trainer", "mesh", "pipe", "pipe-resumed", "tp", "tp-resumed")}
    pipe = [*gpt2, *common, "--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"]
    tp = [*llama, *common, "--strategy", "tp", "--tp_size", "2"]
    finetune_cells(1, {"trainer": [*gpt2, *common, "--output_dir", out["trainer"]],
                       "mesh": [*llama, *common, "--strategy", "tp", "--output_dir", out["mesh"]]}, tmp_path)
    resumed = ["--resume_from_checkpoint", "latest"]
    finetune_cells(2, {"pipe": [*pipe, *save, "--output_dir", out["pipe"]],
                       "pipe-resumed": [*pipe, *resumed, "--output_dir", out["pipe-resumed"]],
                       "tp": [*tp, *save, "--output_dir", out["tp"]],
                       "tp-resumed": [*tp, *resumed, "--output_dir", out["tp-resumed"]]}, tmp_path,
                   options={f"{n}-resumed": {"copy": [tmp_path / n / "checkpoint-2", tmp_path / f"{n}-resumed" /
                                                      "checkpoint-2"]} for n in ("pipe", "tp")})
    for name, ref in {"pipe": "trainer", "tp": "mesh"}.items():
        expected, got = losses(tmp_path / ref), losses(tmp_path / name)
        assert sorted(expected) == sorted(got) == [1, 2, 3, 4], (name, got, expected)
        assert all(abs(got[s] - expected[s]) < 1e-5 for s in expected), (name, got, expected)
        again = losses(tmp_path / f"{name}-resumed")
        assert sorted(again) == [3, 4] and all(again[s] == pytest.approx(got[s], abs=1e-6) for s in again), name
