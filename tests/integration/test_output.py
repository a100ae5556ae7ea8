"""A run's screen holds hftk's progress bar, metrics and one-line messages, not the libraries' notices
(hftk.core.output.quiet_libraries)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, finetune, noise_in


@pytest.mark.slow
def test_default_ddp_run_prints_only_hftk_progress_metrics_and_lines(tmp_path):
    """One 2-rank run with wandb (offline, as conftest sets it), the Trainer's bar and a final save."""
    out = tmp_path / "run"
    result = finetune(2, ["--max_steps", "3", "--report_to", "wandb", "--disable_tqdm", "false",
                          "--output_dir", str(out)])
    assert not noise_in(result.output), "\n".join(noise_in(result.output)) + "\n" + result.output[-4000:]
    assert re.search(r"3/3 \[", result.stderr), "the Trainer's progress bar is hftk's progress: it stays"
    assert "'train_runtime'" in result.stdout  # the Trainer's metrics line
    cpu_lines = result.stdout.count("hftk: torch sees no GPU: running on CPU")  # DeepSpeed's guess, once, rank 0
    assert cpu_lines == (0 if torch.cuda.is_available() else 1), result.stdout
    assert f"Run data is saved locally in {out}" in result.output  # wandb says once where it writes
    assert (out / "final" / "model.safetensors").exists()
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"hftk: done: step 3 in \d+ s, eval loss [\d.]+, perplexity [\d.]+; the model is in "
                        rf"{re.escape(str(out / 'final'))} \(add --resume_from_checkpoint latest .*\)", last), last


def test_a_rerun_of_a_finished_run_says_it_was_already_complete(tmp_path):
    """The README's main command resumes: run twice, the second launch trains nothing and says so."""
    args = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--resume_from_checkpoint", "latest",
            "--output_dir", str(tmp_path / "run")]
    first, again = finetune(1, args), finetune(1, args)
    assert first.returncode == again.returncode == 0, (first.output[-3000:], again.output[-3000:])
    assert first.stderr.strip().splitlines()[-1].startswith("hftk: done: step 2 in "), first.stderr[-2000:]
    assert "(rerunning this command resumes from checkpoint-2)" in first.stderr
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("hftk: the run was already complete at step 2: nothing left to train (eval loss "), last


QUIET_CHECK = r"""
import logging, os, sys
os.environ["WANDB_MODE"] = "offline"
from hftk.core.output import quiet_libraries
quiet_libraries(on_cpu=True)
import datasets, huggingface_hub.utils as hub
from transformers.utils import logging as hf_logging
from transformers.trainer_utils import logger as trainer_utils_logger
from transformers.modeling_utils import logger as modeling_logger
from deepspeed.utils import logger as ds_logger
from deepspeed.accelerator import get_accelerator

assert get_accelerator()._name == "cpu" and os.environ["DS_ACCELERATOR"] == "cpu"
assert ds_logger.getEffectiveLevel() == logging.WARNING  # ZeRO's INFO lines stay off, its warnings stay on
assert not hf_logging.is_progress_bar_enabled() and datasets.utils.are_progress_bars_disabled()
assert not hub.are_progress_bars_disabled(), "Hub download bars are progress the user waits on"
assert os.environ["WANDB_QUIET"] == "true" and os.environ["WANDB_MODE"] == "offline"
pad = ("The tokenizer has new PAD/BOS/EOS tokens that differ from the model config and generation config. "
       "The model config and generation config were aligned accordingly, being updated with the tokenizer's "
       "values. Updated tokens: {}.")
trainer_utils_logger.warning(pad.format({"pad_token_id": 0}))  # dropped: hftk's own pad token
trainer_utils_logger.warning(pad.format({"eos_token_id": 2, "pad_token_id": 0}))  # kept: the EOS changed
modeling_logger.warning("`loss_type=None` was set in the config but it is unrecognized. Using the default loss.")
modeling_logger.warning("`loss_type=focal` was set in the config but it is unrecognized.")  # kept: the user's
modeling_logger.warning("Some weights of the model checkpoint were not used")  # kept: something is wrong
import tempfile, torch, torch.distributed as dist, warnings
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))  # what ZeRO-2 calls: torch's deprecation warning
dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))  # ZeRO-3's, at every step
warnings.warn("`old_arg` is deprecated", FutureWarning)  # kept: any other
from hftk.core.output import DEEPSPEED_OP_BUILT, printed_lines_dropped
with printed_lines_dropped(DEEPSPEED_OP_BUILT):  # as strategies.deepspeed starts DeepSpeed's comm
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    print("a line DeepSpeed means")
print("---", file=sys.stderr, flush=True)
hf_logging.set_verbosity_info()  # what the Trainer does for --log_level info
trainer_utils_logger.warning(pad.format({"pad_token_id": 0}))
modeling_logger.warning("`loss_type=None` was set in the config but it is unrecognized. Using the default loss.")
"""


def test_quiet_libraries_switches_each_library_at_its_source():
    """Each switch, the warnings that stay, and --log_level info bringing the dropped ones back; in a
    fresh interpreter, as a run's rank starts (transformers' integrations not yet imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "WANDB_QUIET")}  # conftest sets one
    result = subprocess.run([sys.executable, "-c", QUIET_CHECK], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    quiet, verbose = result.stderr.split("---\n")
    assert "Running in WANDB offline mode" not in result.stdout
    assert "built successfully" not in result.stdout and "a line DeepSpeed means" in result.stdout
    assert "all_gather_into_tensor" not in quiet and "reduce_scatter_tensor" not in quiet
    assert "`old_arg` is deprecated" in quiet
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
    assert "{'pad_token_id': 0}" not in quiet and "{'eos_token_id': 2, 'pad_token_id': 0}" in quiet
    assert "loss_type=None" not in quiet and "loss_type=focal" in quiet and "Some weights" in quiet
    assert "{'pad_token_id': 0}" in verbose and "loss_type=None" in verbose
