"""Shared test plumbing: launch hftk in 1..N processes under a hard timeout, read its metrics.

:func:`torchrun`, :func:`python`, :func:`finetune` and :func:`finetune_cells` run on warm ranks
(tests/warm.py: forked from a server that has the imports done); :func:`run` starts a real command,
for the tests whose subject is the launch itself. Every launch runs in its own session and is killed
as a process group when it overruns, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftk.bench.launch import free_port, torchrun_command  # noqa: F401 (free_port: for the tests)
from tests import warm

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "scripts" / "finetune.py"
MEMORY_WORKER = ROOT / "hftk" / "bench" / "memory_worker.py"
PLAIN = ROOT / "tests" / "reference" / "plain.py"

# Small, deterministic, fast: tiny GPT-2, dropout off, constant LR, one loss per step.
TINY_ARGS = [
    "--model_name_or_path", "builtin:gpt2-tiny", "--model_dropout", "0",
    "--block_size", "64", "--max_train_samples", "1500",
    "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--learning_rate", "1e-3",
    "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
    "--report_to", "none", "--disable_tqdm", "true", "--seed", "7",
]


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def require_ranks(ranks: int) -> None:
    """Skip (reason in pytest's -rs summary) a launch of ``ranks`` processes this host cannot hold.

    On a CPU-only host gloo runs any number of ranks. On a GPU host hftk gives each rank its own
    device (NCCL, ``cuda:LOCAL_RANK``): two ranks on one GPU would ask for ``cuda:1``, or, as two
    nodes of one rank each, share ``cuda:0``, which NCCL refuses. Every multi-process launch of the
    suite goes through here, so those tests skip on a 1-GPU host and nothing else does.
    """
    import pytest
    import torch

    if ranks > 1 and torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs (one per rank under NCCL); this host has {torch.cuda.device_count()}")


def cpu_only_cases(*cases: Any) -> list[Any]:
    """Parametrize cases for refusals that exist only on a CPU-only host (fp16, dropout in the CPU
    ring attention): on a GPU host those options are valid, so the cases are not generated there."""
    import torch

    return [] if torch.cuda.is_available() else list(cases)


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> Launch:
    """Run ``cmd`` in a new session; on timeout kill the whole process group and fail."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=cwd or ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}")
    return Launch(proc.returncode, out, err)


def torchrun(nproc: int, script: Path | str, args: list[str], timeout: float = 300, nnodes: int = 1,
             env: dict[str, str] | None = None, extra: list[str] | None = None, real: bool = False,
             cwd: Path | None = None) -> Launch:
    """``script`` on ``nproc`` ranks as ``torchrun --nproc_per_node nproc`` starts them (nproc == 1: one plain
    process, as ``python script``), on warm ranks (tests/warm.py), in ``cwd`` (default the repository root).
    ``real`` (a test of what the launcher itself does), a multi-node launch or launcher options (``extra``,
    other than ``["-m"]``: ``script`` is a module) go through the real ``python -m torch.distributed.run`` on
    loopback."""
    require_ranks(nproc * nnodes)
    if nnodes == 1 and extra in (None, [], ["-m"]) and not real:  # ["-m"]: ``script`` names a module
        program = [*(extra or []), str(script)]
        return Launch(*warm.launch(program, args, nproc, timeout, env, cwd, launcher=nproc > 1))
    return run(torchrun_command(nproc, *(extra or []), str(script), *args, nnodes=nnodes), timeout, env, cwd)


def rank_exit_codes(result: Launch) -> dict[int, int]:
    """Each failed rank's exit status (minus the signal that ended it) from a warm launch's report."""
    found = re.search(rf"{re.escape(warm.FAILED_RANKS)} (\{{[^}}]*\}})", result.output)
    return {int(k): int(v) for k, v in json.loads(found.group(1)).items()} if found else {}


def python(program: list[str], timeout: float = 300, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> Launch:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` (``program`` without the interpreter) in one warm
    process (tests/warm.py), in ``cwd``: what the command does, without its seconds of imports."""
    target, args = (program[:2], program[2:]) if program[0] == "-m" else (program[:1], program[1:])
    return Launch(*warm.launch([str(t) for t in target], [str(a) for a in args], 1, timeout, env, cwd,
                               launcher=False))


def finetune(nproc: int, args: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> Launch:
    """Run scripts/finetune.py with the tiny defaults plus ``args``; assert it succeeded."""
    result = torchrun(nproc, FINETUNE, [*TINY_ARGS, *args], timeout=timeout, env=env)
    assert result.returncode == 0, f"finetune failed ({result.returncode}):\n{result.output[-6000:]}"
    return result


def finetune_cells(nproc: int, cells: dict[str, list[str]], root: Path, timeout: float = 600,
                   env: dict[str, str] | None = None, options: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, str]:
    """Several finetune runs (the tiny defaults plus each cell's args), in order, each on ``nproc`` warm ranks
    of its own (:func:`torchrun`). ``options[name]`` adds to cell ``name``: ``copy`` ([src, dst] copied before
    it, e.g. an earlier cell's checkpoint into a resuming cell's folder), ``env`` (variables it runs with, e.g.
    what ``accelerate launch`` of a strategy's YAML sets), ``memory_out`` (a file: the run goes through
    ``hftk bench memory``'s worker, which trains with its probe and writes its record there), ``script`` (a test
    worker that runs scripts/finetune.py's ``main`` with a test hook installed). Each cell gets
    ``timeout`` s (DeepSpeed's first use on a machine builds its C++ ops for minutes). Returns each cell's
    output (stdout + stderr of its ranks); asserts every cell succeeded."""
    outputs: dict[str, str] = {}
    for name, args in cells.items():
        extra = (options or {}).get(name, {})
        if "copy" in extra:
            shutil.copytree(*extra["copy"])
        argv = [*TINY_ARGS, *args]
        script = extra.get("script", FINETUNE)
        if "memory_out" in extra:
            script, argv = MEMORY_WORKER, [*argv, "--memory_out", str(extra["memory_out"])]
        result = torchrun(nproc, script, argv, timeout=timeout, env={**(env or {}), **extra.get("env", {})})
        outputs[name] = result.output
        assert result.returncode == 0, f"finetune cell {name} failed ({result.returncode}):\n{result.output[-6000:]}"
    return outputs


def plain_reference(mode: str, out: Path, args: list[str], model: str | Path = "builtin:gpt2-tiny",
                    timeout: float = 600) -> Path:
    """Train with tests/reference/plain.py -- a plain ``transformers.Trainer`` (``trainer``) or PyTorch
    loop (``loop``), in one plain process (a warm one whose server has not imported hftk), importing nothing
    from hftk -- on the folder of the built-in ``model`` and the shipped corpus, with TINY_ARGS' data and
    optimisation settings plus ``args``.
    ``model``: a built-in name or a model folder.
    Returns ``out``: :func:`losses` and :func:`metrics` read its ``losses.json``, its weights are in
    ``out/final``."""
    from hftk.data.builtin import CORPUS, materialize_model

    shared = dict(zip(TINY_ARGS[::2], TINY_ARGS[1::2]))
    tiny = [x for key in ("--block_size", "--max_train_samples", "--lr_scheduler_type", "--warmup_steps",
                          "--learning_rate", "--seed") for x in (key, shared[key])]
    folder = materialize_model(model) if str(model).startswith("builtin:") else Path(model)
    result = Launch(*warm.launch([str(PLAIN)], [mode, "--model", str(folder), "--text", str(CORPUS),
                                                 "--out", str(out), *tiny, *args], 1, timeout, launcher=False, plain=True))
    assert result.returncode == 0, f"plain reference failed ({result.returncode}):\n{result.output[-6000:]}"
    assert json.loads((Path(out) / "losses.json").read_text())["hftk_loaded"] == []  # really not hftk
    return Path(out)


def metrics(output_dir: Path) -> list[dict[str, Any]]:
    """hftk's metrics file, or a plain reference's ``losses.json`` as the same rows (step, loss,
    grad_norm, the Trainer's epoch; its final eval_loss at the last step)."""
    plain = Path(output_dir) / "losses.json"
    if plain.is_file():
        ref = json.loads(plain.read_text())
        rows = [{"step": int(s), "loss": loss, "grad_norm": ref["grad_norms"][s],
                 **({"epoch": ref["epochs"][s]} if "epochs" in ref else {})} for s, loss in ref["losses"].items()]
        return rows + ([{"step": rows[-1]["step"], "eval_loss": ref["eval_loss"]}] if "eval_loss" in ref else [])
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(output_dir: Path) -> dict[int, float]:
    """Per-step training loss from the metrics file (or a plain reference's)."""
    return {m["step"]: m["loss"] for m in metrics(output_dir) if "loss" in m}


def tiny_blocks(tmp_path: Path, args: list[str] | None = None) -> Any:
    """The training and held-out blocks (``hftk.data.dataset.TokenizedData``) a TINY_ARGS run plus ``args``
    trains and evaluates on, built in this one process by hftk's data pipeline."""
    from hftk.data.dataset import tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare

    cfg = (prepared := prepare([*TINY_ARGS, *(args or []), "--output_dir", str(tmp_path / "probe")])).cfg
    return tokenize_and_pack(cfg.data, prepared.raw, load_tokenizer(cfg.model), prepared.data_format,
                             cfg.training["seed"])


def tiny_eval_loss(model: Any, tmp_path: Path, max_blocks: int | None = None, args: list[str] | None = None) -> float:
    """The Trainer's eval_loss of ``model`` on the held-out blocks a TINY_ARGS run (plus ``args``)
    evaluates (the first ``max_blocks``: a run's ``--max_eval_samples``), in this one process (full
    blocks, every label counted: any batch size gives the per-block mean)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    blocks = tiny_blocks(tmp_path, args).eval
    if max_blocks is not None:
        blocks = blocks.select(range(min(max_blocks, len(blocks))))
    training = TrainingArguments(output_dir=str(tmp_path / "eval"), use_cpu=True, per_device_eval_batch_size=8,
                                 report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=training, eval_dataset=blocks, data_collator=default_data_collator)
    return trainer.evaluate()["eval_loss"]


def load_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys(), f"different tensors: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def greedy_ids(model: Any, tokenizer: Any, prompt: str = "In the beginning", new_tokens: int = 8) -> list[int]:
    """Plain transformers: ``model.generate``'s greedy new token ids for ``prompt`` (the reference)."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def hftk_greedy_ids(checkpoint: Path, prompt: str = "In the beginning", new_tokens: int = 8) -> list[int]:
    """``hftk generate``'s greedy new token ids for ``prompt`` from a checkpoint folder, loaded as it loads it."""
    from transformers import GenerationConfig

    from hftk.publish.generate import generate, load

    model, tokenizer = load(checkpoint)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return generate(model, tokenizer, prompt, config).tolist()


def wandb_run(output_dir: Path) -> dict[str, Any]:
    """The offline wandb run under ``output_dir/wandb``, read from its own ``.wandb`` file: history rows
    and config. That file is a LevelDB-format log (32 KiB blocks, 7-byte record headers) of wandb's
    protobuf ``Record`` messages after a 7-byte ``:W&B`` header; the SDK no longer ships a reader."""
    from wandb.proto import wandb_internal_pb2

    runs = sorted(Path(output_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    assert data[:4] == b":W&B", data[:8]
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # block trailer / zero padding
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: one record complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.HasField("history"):
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            else:  # the config given to wandb.init travels in the run record, later updates in config records
                update = record.run.config.update if record.HasField("run") else \
                    record.config.update if record.HasField("config") else []
                config.update({item.key: json.loads(item.value_json) for item in update})
    return {"history": history, "config": config}


# What a default run printed before hftk.core.output existed, each a library's own line (tests/integration/test_output.py).
NOISE = {
    "DeepSpeed's accelerator guess": re.compile(r"Setting accelerator to CPU|Setting ds_accelerator"),
    "transformers' pad-token alignment": re.compile(r"PAD/BOS/EOS tokens that differ"),
    "transformers' loss_type note": re.compile(r"`loss_type=None` was set"),
    "transformers' import-time wandb line": re.compile(r"\[INFO\] Running in WANDB offline mode"),
    "a datasets / transformers progress bar": re.compile(
        r"(tokenize|pack|cut|Map|Filter|Loading weights|Writing model shards)[^:\n]*:\s+\d+%\|"),
    "wandb's history tables": re.compile(r"wandb: Run (history|summary):"),
    "bitsandbytes' hub-kernel attempt at import": re.compile(
        r"Failed to load CPU gemm_4bit_forward|Skipping publisher trust check"),
}


def noise_in(output: str) -> list[str]:
    """Each :data:`NOISE` kind found in a launch's output, with the text that matched."""
    return [f"{name}: {m.group(0)!r}" for name, pattern in NOISE.items() if (m := pattern.search(output))]


SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
GPT2_SIZES = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
# What rank 0 of a 2-rank torchrun launch sees, so in-process validation judges the launch itself.
TWO_RANKS = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


# What each family's default config keeps that a small test model must change or show: 16-wide heads where the
# config sets head_dim (Gemma 3 and Qwen3 default to 256 / 128), a sliding window shorter than the tests' blocks
# beside full layers (the mask really differs), soft-capped logits, a NoPE layer (SmolLM3).
FAMILY_QUIRKS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                    "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    "smollm3": {"no_rope_layers": [1, 0]},
    # mixtures of experts: 4 experts, top-2, each family's own twist kept: Qwen3-MoE's dense first layer, gpt-oss's
    # sliding / full layers with attention sinks and biased router, OLMoE's full-width q/k norms
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"]},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
}


def make_family(model_type: str, folder: Path, **sizes_given: Any) -> Path:
    """A small model of ``model_type`` from its default config (dropout, tying, sliding window as
    the family ships them, but for :data:`FAMILY_QUIRKS`), seeded weights and a tokenizer, saved as a user's
    folder would be; ``sizes_given`` replace the small default sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hftk.data.builtin import materialize_model

    tokenizer = AutoTokenizer.from_pretrained(materialize_model("builtin:gpt2-tiny"))
    sizes = {**(GPT2_SIZES if model_type == "gpt2" else SIZES), **FAMILY_QUIRKS.get(model_type, {}), **sizes_given}
    defaults = AutoConfig.for_model(model_type)
    if model_type == "gpt_neox":
        sizes.pop("num_key_value_heads")
    if getattr(defaults, "head_dim", None) and "head_dim" not in sizes:
        sizes["head_dim"] = sizes["hidden_size"] // sizes["num_attention_heads"]
    if (getattr(defaults, "pad_token_id", None) or 0) >= len(tokenizer):  # Phi-3's 32000: no such row here
        sizes.setdefault("pad_token_id", None)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


PREFERENCE_WORDS = "blue cat dog moon lamp rock".split()  # one token each (built-in tokenizer): equal row lengths


def preference_pairs(path: Path, rows: int, seed: int) -> Path:
    """DPO pairs with a learnable rule: the chosen completion repeats the word the prompt names, the rejected
    one another."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            word = rng.choice(PREFERENCE_WORDS)
            other = rng.choice([w for w in PREFERENCE_WORDS if w != word])
            f.write(json.dumps({"prompt": f"Repeat {word}:", "chosen": f" {word} {word}",
                                "rejected": f" {other} {other}"}) + "\n")
    return path


# ---- the documentation's command blocks, run as written ----

DOC_PAGES = (ROOT / "README.md", ROOT / "docs")
MARKED_BLOCK = re.compile(r"^<!-- test: ([\w-]+) -->\n```\w*\n(.*?)\n```$", re.M | re.S)


def doc_blocks() -> dict[str, list[tuple[str, str]]]:
    """Every command block the README and the site's pages mark with ``<!-- test: NAME -->`` on the line before
    its fence: name -> [(page, the block's text), ...] (a name marks every copy of one block)."""
    pages = [DOC_PAGES[0], *sorted(DOC_PAGES[1].rglob("*.md"))]
    found: dict[str, list[tuple[str, str]]] = {}
    for page in pages:
        for name, text in MARKED_BLOCK.findall(page.read_text()):
            found.setdefault(name, []).append((str(page.relative_to(ROOT)), text))
    return found


def doc_block(name: str) -> str:
    """The text of the block marked ``name`` (tests/unit/test_readme.py checks that its copies agree)."""
    return doc_blocks()[name][0][1]


def shell_commands(block: str) -> list[tuple[list[str], str | None]]:
    """A block's commands as the shell reads them: lines ending in a backslash joined, comments dropped, and a
    ``<<'TAG'`` here-document made the command's standard input. Returns (argv, stdin) per command."""
    lines, commands, i = block.splitlines(), [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        while line.endswith("\\"):
            line, i = line[:-1] + lines[i], i + 1
        stdin = None
        heredoc = re.search(r"<<'(\w+)'", line)
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            stdin, i, line = "\n".join(lines[i:end]) + "\n", end + 1, line[:heredoc.start()]
        if argv := shlex.split(line, comments=True):
            commands.append((argv, stdin))
    return commands


def doc_project(root: Path) -> Path:
    """A folder to run documented commands in, as from the repository root: ``scripts``, ``accelerate_configs``,
    ``examples`` and ``.venv`` are the repository's (links); what a command writes (``outputs/``, data files) stays
    here."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "accelerate_configs", "examples", ".venv"):
        (root / name).symlink_to(ROOT / name)
    return root


def run_doc_command(argv: list[str], stdin: str | None, cwd: Path, timeout: float = 600) -> Launch:
    """One documented command, as written, from ``cwd`` (see :func:`doc_project`). The launches run on warm
    ranks: ``torchrun --nproc_per_node N SCRIPT ...`` as it starts them, ``accelerate launch ... SCRIPT ...`` with
    the ranks and the environment accelerate's own launcher derives from its arguments and config file;
    ``hftk ...`` runs in one warm process; ``python -`` with its here-document as a plain interpreter."""
    if argv[0] == "torchrun" and argv[1] == "--nproc_per_node":
        return torchrun(int(argv[2]), argv[3], argv[4:], timeout=timeout, cwd=cwd)
    if argv[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_multi_gpu_env

        given = list(argv[2:])
        if "--config_file" in given:  # the config file as the launch in ``cwd`` reads it
            at = given.index("--config_file") + 1
            given[at] = str(cwd / given[at])
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(given))
        assert args.multi_gpu and not (args.use_deepspeed or args.use_fsdp), f"no warm launch for {argv}"
        env = {k: v for k, v in prepare_multi_gpu_env(args).items() if os.environ.get(k) != v}
        return torchrun(args.num_processes, args.training_script, args.training_script_args, timeout=timeout,
                        env=env, cwd=cwd)
    if argv[0] == "hftk":
        return python(["-m", "hftk.cli", *argv[1:]], timeout=timeout, cwd=cwd)
    if argv == ["python", "-"]:
        done = subprocess.run([sys.executable, "-"], input=stdin, capture_output=True, text=True, cwd=cwd,
                              timeout=timeout)
        return Launch(done.returncode, done.stdout, done.stderr)
    raise AssertionError(f"no runner for the documented command {argv}: add one to tests.helpers.run_doc_command")
