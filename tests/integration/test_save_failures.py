"""A save that fails on one rank stops every rank with one line within seconds, and keeps what the user had
(issue 42: after the last step rank 0's completeness check failed on an MoE folder, rank 0 waited in the save's
settle and rank 1 in the strategy's barrier, for ever); and the MoE folders that started it now save whole.

The faults come from tests/workers/fail_in_save.py, whose ranks ignore SIGTERM: the launcher's stop after the
first rank exits cannot end a waiting rank, so every rank must leave on its own (exit code 2, not -9).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from hftk.checkpoint.atomic import STAGING_DIR, is_complete, list_checkpoints
from hftk.comm.rank_failure import GRACE_S
from hftk.config.strategy_table import STRATEGIES
from tests.helpers import ROOT, TINY_ARGS, Launch, make_family, rank_exit_codes, torchrun

pytestmark = pytest.mark.slow

WORKERS = ROOT / "tests" / "workers"
SHORT = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--max_train_samples", "50"]
LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]  # sequence parallel splits attention heads GPT-2 fuses
STRATEGY_ARGS = {"pipeline": ["--pp_size", "2", "--pp_microbatches", "2"], "tp": ["--tp_size", "2", *LLAMA],
                 "cp": ["--cp_size", "2", *LLAMA], "sp": ["--sp_size", "2", *LLAMA],
                 "ep": ["--model_name_or_path", "builtin:qwen3-moe-small"]}  # expert parallel needs experts
BOUND_S = GRACE_S + 15  # fault to every rank's exit: the watch's grace, then the report; a loaded CPU's margin
PREVIOUS = b"the weights of the user's previous final"


def run_with_fault(out: Path, strategy: str, fault: str, extra: list[str] = ()) -> tuple[Launch, float]:
    """2 ranks of ``strategy`` with ``fault`` (``HFTK_FAIL_SAVE``); the launch and the seconds from the fault to
    the launch's end (every rank gone)."""
    args = [*TINY_ARGS, "--strategy", strategy, *SHORT, *STRATEGY_ARGS.get(strategy, []), *extra,
            "--output_dir", str(out)]
    result = torchrun(2, WORKERS / "fail_in_save.py", args, timeout=300, env={"HFTK_FAIL_SAVE": fault})
    ended = time.time()
    found = re.search(r"hftk-test: fault at ([0-9.]+)", result.output)
    assert found, f"the fault never struck:\n{result.output[-5000:]}"
    return result, ended - float(found.group(1))


def assert_every_rank_stopped_with_one_line(result: Launch, seconds: float, *fragments: str) -> str:
    """Both ranks left on their own with hftk's code within BOUND_S of the fault; one error line, holding each of
    ``fragments``; returns it."""
    assert rank_exit_codes(result) == {0: 2, 1: 2}, result.output[-5000:]
    assert seconds <= BOUND_S, f"{seconds:.1f}s from the fault to the last rank's exit\n{result.output[-3000:]}"
    lines = [line for line in result.output.splitlines() if line.startswith("hftk: error")]
    assert len(lines) == 1, result.output[-5000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def previous_final(out: Path) -> Path:
    """What a user's earlier run left in ``out/final``."""
    final = out / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(PREVIOUS)
    return final


def assert_kept(final: Path) -> None:
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"], sorted(final.iterdir())
    assert (final / "model.safetensors").read_bytes() == PREVIOUS
    assert not (final.parent / STAGING_DIR).exists()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_failed_final_check_on_one_rank_stops_every_rank_with_one_line(strategy, tmp_path):
    """Rank 0's completeness check of final/ fails (the issue's failure): before, zero1-3, zero3_offload and fsdp
    hung in the barrier after the check (ddp had no check)."""
    out = tmp_path / "run"
    final = previous_final(out)
    result, seconds = run_with_fault(out, strategy, "final:0:check")
    assert_every_rank_stopped_with_one_line(result, seconds, f"saving {final} failed on rank 0: ",
                                            "lacks hftk_test.missing.weight [1] (saved: nothing)",
                                            f"({final} keeps its previous content)")
    assert "Traceback" not in result.output, result.output[-3000:]
    assert_kept(final)


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_a_rank_failing_while_the_others_wait_in_the_saves_collectives_stops_every_rank(strategy, tmp_path):
    """Rank 1 fails entering final's save; rank 0 waits in the save's first collective (FSDP's gather under the
    Trainer engine, the pipeline's stage barrier under the loop engine) that rank 1 never joins: the failure watch
    ends it. Before, rank 1 met rank 0 in another collective: gloo aborted it (SIGABRT), rank 0 reported gloo's
    error."""
    out = tmp_path / "run"
    final = previous_final(out)
    result, seconds = run_with_fault(out, strategy, "final:1:enter")
    assert_every_rank_stopped_with_one_line(
        result, seconds, f"saving {final} failed on rank 1: RuntimeError: injected: rank 1 fails entering the save "
        "of final", "the traceback above (rank 1) shows where")
    assert seconds >= GRACE_S, "rank 0 left before the watch's grace: it was not waiting in a collective"
    assert_kept(final)


def test_a_checkpoint_failing_on_one_rank_keeps_the_previous_one_latest(tmp_path):
    """Rank 1's on_save callback of checkpoint-2 fails while rank 0 waits to publish it."""
    out = tmp_path / "run"
    result, seconds = run_with_fault(out, "ddp", "checkpoint-2:1:on_save",
                                     ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"])
    assert_every_rank_stopped_with_one_line(
        result, seconds, f"saving {out / 'checkpoint-2'} failed on rank 1: RuntimeError: injected",
        "(checkpoint-1 is intact and still the latest)")
    assert list_checkpoints(out) == [out / "checkpoint-1"] and is_complete(out / "checkpoint-1")
    assert not (out / "checkpoint-2").exists() and not (out / "final").exists()


# ---- the models: MoE experts fused live, written per expert

MOE = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return make_family("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3-moe", **MOE)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_an_moe_final_saved_from_shards_loads_to_the_live_models_logits(strategy, qwen3_moe, tmp_path):
    """Qwen3-MoE (4 experts, top-2) trained 2 steps on 2 ranks: final/ holds the experts per expert, passes the
    check, and loads with from_pretrained to the logits the live sharded model gave on the same tokens."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    out, logits = tmp_path / "run", tmp_path / "live_logits.pt"
    result = torchrun(2, WORKERS / "live_logits.py",
                      [*TINY_ARGS, "--model_name_or_path", str(qwen3_moe), "--strategy", strategy, *SHORT,
                       "--max_steps", "2", "--output_dir", str(out)], timeout=300, env={"HFTK_LOGITS_OUT": str(logits)})
    assert result.returncode == 0, result.output[-5000:]
    final = out / "final"
    assert is_complete(final)
    live = torch.load(logits, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(final)
    check_complete(final, shapes_of(model))
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()  # written per expert
    with torch.no_grad():
        loaded = model(input_ids=live["input_ids"]).logits
    assert (loaded - live["logits"]).abs().max() <= 1e-5
