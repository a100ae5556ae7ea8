"""Every strategy x every family hftk claims x {full, LoRA}: trains with parity to a one-process reference and
saves a loadable ``final/``, or is refused before launch, exactly as ``hftk.models.support_table.expected`` says
(the table the README renders); and a 4-bit (QLoRA) base of every family trains under ddp.

The models are made here from each family's default config (small sizes, the quirks of
``tests.helpers.FAMILY_QUIRKS``) with ``save_pretrained``, as a user's own folder would be, not hftk's built-ins.
A refusal is found in-process by ``hftk.run.prepare.prepare`` (validation, before any process group, as
``hftk train`` runs it). Every cell that passes validation runs for real on 2 gloo ranks for 3 optimizer steps,
each ``scripts/finetune.py`` on warm ranks of its own (tests/warm.py: forked from a process that has the imports
done), at a global batch of 2 rows (the Trainer's strategies and ep: 1 per rank; the other loop strategies: 2 on
their one data-parallel replica).

The reference of each family is tests/reference/plain.py's loop (no hftk, no Trainer) on one process at batch 2 with
torch's AdamW, which every cell is given (``--optim adamw_torch``), and the Trainer's loss divisor (the predicted
tokens for a ``...ForCausalLM`` class, every label otherwise; the mesh strategies, tp / cp / sp / ep, always divide
by the predicted tokens). Its LoRA runs are PEFT's own ``all-linear`` targets (and a mixture of experts' 3-D expert
weights), which hftk's default targets must equal. A mixture of experts' balancing loss is the mean over a step's
micro-batches: the reference cuts its batch as the cell does (one row per rank under the Trainer's strategies and
ep, the pipeline's two micro-batches; tp's one batch of two) and runs the experts as hftk does (grouped_mm).
Each cell's per-step losses and final weights (the adapter's, for LoRA) equal the reference's within 1e-5.

Every mixture of experts resumes exactly under fsdp, pipeline and ep from its cell's checkpoint-2 alone; ep's
resume also changes the layout, family by family (:data:`EP_RESUMES`): the experts redistributed on load.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from hftk.config.strategy_table import STRATEGIES as TABLE
from hftk.config.support import STRATEGIES, Refusal
from hftk.models.support_table import MATRIX_FAMILIES, expected, family_name
from tests.helpers import FINETUNE, TWO_RANKS, losses, make_family, plain_reference, torchrun

# The first ZeRO-3 offload cell builds DeepSpeed's cpu_adam op once per machine (minutes, cached after).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 3
BLOCK = 32
# AdamW's epsilon at 1e-4: with the default 1e-8 its normalisation turns the last-bit differences of a 2-rank
# gradient sum into up to 1.3e-5 on the few weights whose gradient is near zero (Gemma 3 under zero3, 3 steps);
# 1e-4 keeps the update linear there, so the weights' 1e-5 checks the strategies, not rounding (as tests/integration/test_lora.py)
COMMON = ["--model_dropout", "0", "--block_size", str(BLOCK), "--max_train_samples", "200", "--max_steps", str(STEPS),
          "--lr_scheduler_type", "constant", "--learning_rate", "1e-3", "--warmup_steps", "0", "--optim",
          "adamw_torch", "--adam_epsilon", "1e-4", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy",
          "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]
STRATEGY_ARGS = {"pipeline": ["--pp_size", "2", "--pp_microbatches", "2"], "tp": ["--tp_size", "2"],
                 "cp": ["--cp_size", "2"], "sp": ["--sp_size", "2"]}
MESH = ("tp", "cp", "sp", "ep")  # their loss: the mean over predicted tokens, whatever the model class
OWN_ROWS = ("ep",)  # loop strategies whose 2 ranks read different rows (the others' ranks share them)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")
# Exact resume: these cells save at step 2, and a resumed run continues from that checkpoint alone: every mixture of
# experts (router, experts, balancing loss, optimizer state through FSDP2's sharded checkpoint, the pipeline's
# stage files and ep's DCP shards), Gemma 3's tied head across pipeline stages, Qwen3's and Phi-3's tensor-parallel
# DCP shards.
RESUMED = {("fsdp", f) for f in MOE_FAMILIES} | {("pipeline", f) for f in (*MOE_FAMILIES, "gemma3_text")} | \
    {("tp", "qwen3"), ("tp", "phi3")} | {("ep", f) for f in MOE_FAMILIES}
# How ep's resumed run differs from the cell that saved (2 ranks, ep 2, a row each): (ranks, options). At ep 1 every
# expert is FSDP2-sharded over both ranks; on one rank all of them are whole there (the same 2 rows as 2 micro-batches).
EP_RESUMES = {"qwen3_moe": (2, ["--ep_size", "1"]), "mixtral": (1, ["--gradient_accumulation_steps", "2"]),
              "gpt_oss": (2, []), "olmoe": (1, ["--gradient_accumulation_steps", "2"])}
SAVE_AT = ["--save_strategy", "steps", "--save_steps", "2"]
LORA = ["--lora_r", "4", "--lora_dropout", "0"]
QLORA = ["--load_in_4bit", *LORA]
TOLERANCE = 1e-5


def cell_argv(strategy: str, model: Path, variant: str, out: Path) -> list[str]:
    per_rank = "1" if TABLE[strategy].engine == "trainer" or strategy in OWN_ROWS else "2"  # a global batch of 2
    extra = {"full": [], "lora": LORA, "qlora": QLORA}[variant]
    return ["--model_name_or_path", str(model), "--strategy", strategy, *COMMON, "--per_device_train_batch_size",
            per_rank, *STRATEGY_ARGS.get(strategy, []), *extra, "--output_dir", str(out)]


def refusal(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Refusal | None:
    """The one-line refusal ``hftk train`` would print before launch on 2 ranks, or None."""
    from hftk.core.errors import HftkError
    from hftk.run.prepare import prepare

    with monkeypatch.context() as env:
        for key, value in TWO_RANKS.items():
            env.setenv(key, value)
        try:
            prepare(argv)
        except HftkError as exc:
            return Refusal(exc.field, exc.problem, exc.fix)
    return None


def divisor(model: Path, strategy: str) -> str:
    """What the reference divides the summed loss by: the Trainer's rule, or the mesh loop's."""
    import json

    architecture = json.loads((model / "config.json").read_text())["architectures"][0]
    return "targets" if strategy in MESH or architecture.endswith("ForCausalLM") else "labels"


def micro_batches(strategy: str, moe: bool) -> int:
    """How the cell cuts its batch of 2 for a mixture of experts' balancing loss (1 for a dense model: its loss is
    the same however the batch is cut)."""
    return 1 if not moe or strategy in MESH and strategy not in OWN_ROWS else 2


def reference_name(family: str, lora: bool, loss_divisor: str, micro: int) -> str:
    return f"ref-{family}-{'lora' if lora else 'full'}-{loss_divisor}-{micro}"


def weights(final: Path, lora: bool) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(final / ("adapter_model.safetensors" if lora else "model.safetensors")))


def check_final(final: Path, model: Path, lora: bool) -> None:
    """``final/`` loads back: the full model with from_pretrained, the adapter with PEFT onto its base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if lora:
        assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), final)
        assert any("lora_" in name for name, _ in loaded.named_parameters())
    else:
        AutoModelForCausalLM.from_pretrained(final)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
           ) -> tuple[dict[tuple[str, str, str], Any], dict[str, Path]]:
    """Every cell's outcome: ``"trains"`` (ran, losses and final weights equal to its reference, ``final/`` loaded
    back; QLoRA: finite losses) or its Refusal; and the model folder of each family."""
    from transformers import AutoConfig

    from hftk.models.spec import model_spec

    root = tmp_path_factory.mktemp("matrix")
    start = time.perf_counter()
    models = {family: make_family(family, root / "models" / family) for family in MATRIX_FAMILIES}
    outcomes: dict[tuple[str, str, str], Any] = {}
    cells, references = [], {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for strategy in STRATEGIES:
            for family, model in models.items():
                for variant in ("full", "lora", "qlora"):
                    if variant == "qlora" and strategy != "ddp":
                        continue
                    out = root / "runs" / f"{strategy}-{family}-{variant}"
                    argv = cell_argv(strategy, model, variant, out)
                    if (strategy, family) in RESUMED and variant == "full":
                        argv = [*argv, *SAVE_AT]
                    refused = refusal(argv, monkeypatch)
                    if refused is not None:
                        outcomes[(strategy, family, variant)] = refused
                        continue
                    ref = None
                    if variant != "qlora":
                        moe = model_spec(AutoConfig.from_pretrained(model)).moe is not None
                        key = (model, variant == "lora", divisor(model, strategy), micro_batches(strategy, moe))
                        ref = reference_name(family, *key[1:])
                        references[ref] = (*key, moe)
                    cells.append({"name": out.name, "argv": argv, "key": (strategy, family, variant), "out": out,
                                  "ref": ref})
    began = time.perf_counter()
    for name, (model, lora, loss_divisor, micro, moe) in references.items():
        plain_reference("loop", root / name, ["--max_steps", str(STEPS), "--batch_size", "2", "--block_size",
                                              str(BLOCK), "--max_train_samples", "200", "--optim", "adamw_torch",
                                              "--adam_epsilon", "1e-4",
                                              "--loss_divisor", loss_divisor, "--micro_batches", str(micro),
                                              *(["--lora_r", "4"] if lora else []),
                                              *(["--experts_implementation", "grouped_mm"] if moe else [])],
                        model=model)
    referenced = time.perf_counter() - began
    began = time.perf_counter()
    for cell in cells:
        result = torchrun(2, FINETUNE, cell["argv"], timeout=900)
        assert result.returncode == 0, f"matrix cell {cell['name']} failed:\n{result.output[-8000:]}"
    for strategy, family in sorted(key for key in RESUMED if outcomes.get((*key, "full")) is None):
        whole, resumed = root / "runs" / f"{strategy}-{family}-full", root / "runs" / f"resumed-{strategy}-{family}"
        shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
        ranks, changed = EP_RESUMES[family] if strategy == "ep" else (2, [])
        argv = [*cell_argv(strategy, models[family], "full", resumed), *SAVE_AT, "--resume_from_checkpoint", "latest",
                *changed]
        result = torchrun(ranks, FINETUNE, argv, timeout=900)
        assert result.returncode == 0, f"resumed {strategy} {family} failed:\n{result.output[-8000:]}"
    launched = time.perf_counter() - began
    loaded: set[tuple[str, str]] = set()
    for cell in cells:
        strategy, family, variant = cell["key"]
        got = losses(cell["out"])
        assert len(got) == STEPS and all(math.isfinite(v) for v in got.values()), (cell["name"], got)
        if cell["ref"] is not None:
            want = losses(root / cell["ref"])
            assert got == pytest.approx(want, abs=TOLERANCE), (cell["name"], got, want)
            lora = variant == "lora"
            mine, theirs = weights(cell["out"] / "final", lora), weights(root / cell["ref"] / "final", lora)
            assert mine.keys() == theirs.keys(), (cell["name"], sorted(set(mine) ^ set(theirs))[:4])
            worst = max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine)
            assert worst < TOLERANCE, (cell["name"], worst)
        if (family, variant) not in loaded:  # its folder format is the same under every strategy: loaded once
            check_final(cell["out"] / "final", models[family], variant != "full")
            loaded.add((family, variant))
        outcomes[cell["key"]] = "trains"
    summary = (f"\nmatrix: {len(references)} one-process references ({referenced:.0f} s), {len(cells)} cells trained "
               f"(2 warm ranks each, {launched:.0f} s), {len(outcomes) - len(cells)} refused before launch; "
               f"{time.perf_counter() - start:.0f} s in all\n{render_outcomes(outcomes)}")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown in the test output, as capsys.disabled() does
        print(summary, flush=True)
    return outcomes, models


def render_outcomes(outcomes: dict[tuple[str, str, str], Any]) -> str:
    def cell(key: tuple[str, str, str]) -> str:
        got = outcomes.get(key, "-")
        return got if isinstance(got, str) else f"refused ({got.field})"

    lines = [f"{'strategy':<14} | " + " | ".join(f"{family_name(f) + ' full / LoRA':<40}" for f in MATRIX_FAMILIES)]
    for s in STRATEGIES:
        lines.append(f"{s:<14} | " + " | ".join(f"{cell((s, f, 'full')) + ' / ' + cell((s, f, 'lora')):<40}"
                                                for f in MATRIX_FAMILIES))
    return "\n".join(lines)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_cell_trains_with_parity_or_is_refused_as_the_support_table_says(matrix, strategy):
    from transformers import AutoConfig

    outcomes, models = matrix
    for family in MATRIX_FAMILIES:
        config = AutoConfig.from_pretrained(models[family])
        for variant in ("full", "lora"):
            got = outcomes[(strategy, family, variant)]
            want = expected(strategy, config, variant == "lora", BLOCK)
            if want is None:
                assert got == "trains", (strategy, family, variant, got)
            else:
                assert isinstance(got, Refusal) and got.field == want.field, (strategy, family, variant, got)
                assert got.problem == want.problem, (strategy, family, variant, got)


def test_a_4bit_base_of_every_family_trains_under_ddp(matrix):
    outcomes, _ = matrix
    assert all(outcomes[("ddp", family, "qlora")] == "trains" for family in MATRIX_FAMILIES)


@pytest.mark.parametrize("strategy,family", sorted(RESUMED))
def test_resumes_exactly(matrix, strategy, family):
    """From checkpoint-2 alone, step 3 and the final weights equal the uninterrupted run's (ep: on the layout
    :data:`EP_RESUMES` names)."""
    root = matrix[1][family].parents[1] / "runs"
    whole, resumed = losses(root / f"{strategy}-{family}-full"), losses(root / f"resumed-{strategy}-{family}")
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(whole[3], abs=1e-6)
    mine, theirs = (weights(root / name / "final", False) for name in (f"resumed-{strategy}-{family}",
                                                                        f"{strategy}-{family}-full"))
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in theirs) < 1e-6


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_metrics_reach_metrics_jsonl(matrix, family):
    """Every logged step of a mixture of experts carries the balancing term (unscaled) and the busiest expert's
    load over the mean, under the Trainer (ddp) and hftk's loop (pipeline, ep: the counts of every rank's tokens)."""
    from tests.helpers import metrics

    root = matrix[1][family].parents[1] / "runs"
    for strategy in ("ddp", "pipeline", "ep"):
        logged = [m for m in metrics(root / f"{strategy}-{family}-full") if "loss" in m]
        assert len(logged) == STEPS, (strategy, logged)
        assert all(m["moe_aux_loss"] > 0 and m["expert_load_max_mean"] >= 1.0 for m in logged), (strategy, logged)


def test_an_expert_adapter_merges_into_the_model_it_trained(matrix, tmp_path):
    """``hftk export --merge`` of a LoRA adapter on Qwen3-MoE's experts (PEFT target_parameters) gives a standard
    folder whose logits equal the base with the adapter applied."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hftk.cli import main as hftk

    base = matrix[1]["qwen3_moe"]
    adapter = base.parents[1] / "runs" / "ddp-qwen3_moe-lora" / "final"
    assert hftk(["export", str(adapter), str(tmp_path / "merged"), "--merge"]) == 0
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
