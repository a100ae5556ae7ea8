"""Every strategy x every family hftk claims x {full, LoRA}: trains and saves a loadable ``final/``, or
is refused before launch, exactly as ``hftk.config.support.expected`` says (the table the README renders).

The models are made here from each family's default config (small sizes) with ``save_pretrained``,
as a user's own folder would be, not hftk's built-ins. A refusal is found in-process by
``hftk.run.prepare.prepare`` (validation, before any process group, as ``hftk train`` runs it). Every cell
that passes validation runs for real on 2 gloo ranks for 2 optimizer steps, each ``scripts/finetune.py``
on warm ranks of its own (tests/warm.py: forked from a process that has the imports done).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from hftk.config.family_table import FAMILIES
from hftk.config.support import STRATEGIES, Refusal, expected
from tests.helpers import FINETUNE, TWO_RANKS, losses, make_family, torchrun

# The first ZeRO-3 offload cell builds DeepSpeed's cpu_adam op once per machine (minutes, cached after).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

COMMON = ["--model_dropout", "0", "--block_size", "32", "--max_train_samples", "200", "--max_steps", "2",
          "--per_device_train_batch_size", "2", "--lr_scheduler_type", "constant", "--learning_rate", "1e-3",
          "--warmup_steps", "0", "--logging_steps", "1", "--eval_fraction", "0", "--eval_strategy", "no",
          "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]
STRATEGY_ARGS = {"pipeline": ["--pp_size", "2", "--pp_microbatches", "2"], "tp": ["--tp_size", "2"],
                 "cp": ["--cp_size", "2"], "sp": ["--sp_size", "2"]}
LORA = ["--lora_r", "4"]


def cell_argv(strategy: str, model: Path, lora: bool, out: Path) -> list[str]:
    return ["--model_name_or_path", str(model), "--strategy", strategy, *COMMON, *STRATEGY_ARGS.get(strategy, []),
            *(LORA if lora else []), "--output_dir", str(out)]


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
def matrix(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> dict[tuple[str, str, bool], Any]:
    """Every cell's outcome: ``"trains"`` (ran, finite losses, ``final/`` loaded back) or its Refusal."""
    root = tmp_path_factory.mktemp("matrix")
    start = time.perf_counter()
    models = {family: make_family(family, root / "models" / family) for family in FAMILIES}
    outcomes: dict[tuple[str, str, bool], Any] = {}
    cells = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        for strategy in STRATEGIES:
            for family, model in models.items():
                for lora in (False, True):
                    out = root / "runs" / f"{strategy}-{family}-{'lora' if lora else 'full'}"
                    argv = cell_argv(strategy, model, lora, out)
                    refused = refusal(argv, monkeypatch)
                    if refused is not None:
                        outcomes[(strategy, family, lora)] = refused
                    else:
                        cells.append({"name": out.name, "argv": argv, "key": (strategy, family, lora), "out": out})
    launched = time.perf_counter()
    for cell in cells:
        result = torchrun(2, FINETUNE, cell["argv"], timeout=900)
        assert result.returncode == 0, f"matrix cell {cell['name']} failed:\n{result.output[-8000:]}"
    launched = time.perf_counter() - launched
    for cell in cells:
        logged = losses(cell["out"])
        assert len(logged) == 2 and all(math.isfinite(v) for v in logged.values()), (cell["name"], logged)
        check_final(cell["out"] / "final", models[cell["key"][1]], cell["key"][2])
        outcomes[cell["key"]] = "trains"
    summary = (f"\nmatrix: {len(cells)} cells trained (2 warm ranks each, {launched:.0f} s), "
               f"{len(outcomes) - len(cells)} refused before launch; {time.perf_counter() - start:.0f} s in all"
               f"\n{render_outcomes(outcomes)}")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown in the test output, as capsys.disabled() does
        print(summary, flush=True)
    return outcomes


def render_outcomes(outcomes: dict[tuple[str, str, bool], Any]) -> str:
    def cell(key: tuple[str, str, bool]) -> str:
        got = outcomes[key]
        return got if got == "trains" else f"refused ({got.field})"

    lines = [f"{'strategy':<14} | " + " | ".join(f"{FAMILIES[f].name + ' full / LoRA':<48}" for f in FAMILIES)]
    for s in STRATEGIES:
        lines.append(f"{s:<14} | " + " | ".join(f"{cell((s, f, False)) + ' / ' + cell((s, f, True)):<48}"
                                                for f in FAMILIES))
    return "\n".join(lines)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_cell_trains_or_is_refused_as_the_support_table_says(matrix, strategy):
    for family in FAMILIES:
        for lora in (False, True):
            want = expected(strategy, family, lora)
            got = matrix[(strategy, family, lora)]
            if want is None:
                assert got == "trains", (strategy, family, lora, got)
            else:
                assert isinstance(got, Refusal) and got.field == want.field, (strategy, family, lora, got)
