"""Push to the Hub: retries against a failing server, round trip, model card, privacy, the token kept secret.

The Hub is ``tests/hub_server.py`` on 127.0.0.1, driven by the real huggingface_hub client.
The training run is the shared reference run of ``tests/faults.py`` (2-rank DDP, 30 steps,
``--hub_strategy checkpoint``), whose server fails the first two commits and the first LFS
upload.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from hftk.checkpoint.run_record import CARD_FILE, RUN_FILE
from hftk.publish.hub import MODEL_PATTERNS, folder_files
from tests.faults import REPO, TOKEN, hub_env, hub_server, reference_run
from tests.helpers import TINY_ARGS, load_weights, max_weight_diff, metrics, python

pytestmark = pytest.mark.slow
AFTER_THE_FACT = "hftk-test/checkpoint-15"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    out, result = reference_run(tmp_path_factory.getbasetemp())
    hub = hub_server()
    cli = python(["-m", "hftk.cli", "push", str(out / "checkpoint-15"), AFTER_THE_FACT,
               "--retry_backoff_s", "0.1"], timeout=300, env=hub_env(hub))
    return out, result, hub, cli


def repo_files(hub, repo_id: str) -> dict[str, bytes]:
    return hub.state.files(repo_id)


def test_failed_attempts_are_retried_and_reported(pushed):
    out, _, _, _ = pushed
    pushes = [m for m in metrics(out) if "hub_push" in m]
    first = next(m for m in pushes if m["hub_push"] != "superseded")
    assert first["hub_push"] == "ok" and first["hub_attempts"] == 3  # two injected commit failures
    final = [m for m in pushes if m["hub_target"] == "final"]
    assert final and final[-1]["hub_push"] == "ok"


def test_repository_holds_the_complete_final_model_and_last_checkpoint(pushed):
    out, _, hub, _ = pushed
    files = repo_files(hub, REPO)
    expected = {rel: path.read_bytes() for rel, path in folder_files(out / "final").items()}
    expected.update({rel: p.read_bytes() for rel, p in folder_files(out / "checkpoint-30", prefix="last-checkpoint/").items()})
    expected[".gitattributes"] = files[".gitattributes"]
    assert files.keys() == expected.keys()
    for rel in files:
        assert files[rel] == expected[rel], rel
    assert {"model.safetensors", "config.json", "tokenizer.json", CARD_FILE} <= files.keys()


def test_repository_is_private_and_only_hftk_committed(pushed):
    _, _, hub, _ = pushed
    repo = hub.state.repos[REPO]
    assert repo.private
    assert all(m.startswith("hftk: ") for m in repo.messages[1:]), repo.messages  # no Trainer push
    assert repo.messages[-1] == "hftk: final model"


def test_download_and_reload_round_trip(pushed, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, hub, _ = pushed
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    folder = Path(snapshot_download(REPO, endpoint=hub.base_url, token=TOKEN, cache_dir=tmp_path,
                                    allow_patterns=["*.json", "*.safetensors", "*.md"]))
    assert max_weight_diff(load_weights(out / "final"), load_weights(folder)) == 0.0
    local = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    remote = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["In the beginning God created the heaven and the earth."] * 2, return_tensors="pt")
    with torch.no_grad():
        a = local(**batch, labels=batch["input_ids"]).loss
        b = remote(**batch, labels=batch["input_ids"]).loss
    assert torch.isfinite(a) and a.item() == b.item()


def test_hftk_generate_reads_a_pushed_model_by_its_hub_id(pushed, tmp_path, monkeypatch, capsys):
    """``hftk generate REPO`` downloads the private repo with the token from the environment and says what the
    run's final/ says (plain ``generate``, greedy); a repo the Hub does not have is one line and exit 2."""
    import huggingface_hub.constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.cli import main

    out, _, hub, _ = pushed
    for name, value in (("ENDPOINT", hub.base_url), ("HF_HUB_DISABLE_XET", True), ("HF_HUB_OFFLINE", False),
                        ("HUGGINGFACE_CO_URL_TEMPLATE", hub.base_url + "/{repo_id}/resolve/{revision}/{filename}"),
                        ("HF_HUB_CACHE", str(tmp_path / "cache"))):
        monkeypatch.setattr(huggingface_hub.constants, name, value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out / "final").eval(), AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("In the beginning", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    capsys.readouterr()
    assert main(["generate", REPO, "--prompt", "In the beginning", "--max_new_tokens", "8"]) == 0
    said = capsys.readouterr()
    assert tokenizer.decode(new, skip_special_tokens=True).strip() in said.out and TOKEN not in said.out + said.err
    (snapshot,) = (tmp_path / "cache").glob("models--*/snapshots/*")
    assert not (snapshot / "last-checkpoint").exists()  # the model files only, not the pushed checkpoint
    assert main(["generate", "hftk-test/no-such-model", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'hftk-test/no-such-model' is no local folder" in err[0], err


def test_model_card_is_present_and_accurate(pushed):
    out, _, hub, _ = pushed
    card = repo_files(hub, REPO)[CARD_FILE].decode()
    meta = yaml.safe_load(re.match(r"^---\n(.*?)\n---\n", card, re.S).group(1))
    assert {"hftk", "ddp"} <= set(meta["tags"]) and meta["library_name"] == "transformers"
    final_eval = [m for m in metrics(out) if "eval_loss" in m][-1]["eval_loss"]
    for fact in ("`builtin:gpt2-tiny`", "`builtin:kjv`", "**ddp** over 2 process(es)", "optimizer steps: 30",
                 "| learning_rate | 0.001 |", "| global_batch_size | 8 |", "| per_device_train_batch_size | 4 |",
                 f"| eval_loss | {final_eval:.6g} |", "first 200 rows", "- hftk 0.1.0"):
        assert fact in card, fact
    record = json.loads(repo_files(hub, REPO)[RUN_FILE])
    assert record["metrics"]["eval_loss"] == final_eval and record["world_size"] == 2


def test_hftk_push_after_the_fact(pushed):
    out, _, hub, cli = pushed
    assert cli.returncode == 0, cli.output[-4000:]
    files = repo_files(hub, AFTER_THE_FACT)
    local = folder_files(out / "checkpoint-15", MODEL_PATTERNS)
    assert set(files) == {".gitattributes", CARD_FILE, RUN_FILE, *local}  # no optimizer / RNG / trainer state
    assert files["model.safetensors"] == (out / "checkpoint-15" / "model.safetensors").read_bytes()
    assert "optimizer steps: 15" in files[CARD_FILE].decode()
    assert hub.state.repos[AFTER_THE_FACT].private


def test_token_is_used_but_never_written_or_logged(pushed):
    out, result, hub, cli = pushed
    writes = [r for r in hub.state.requests if r["kind"] in ("create", "preupload", "lfs-batch", "commit")]
    assert writes and all(r["headers"].get("authorization") == f"Bearer {TOKEN}" for r in writes)
    assert TOKEN not in result.output and TOKEN not in cli.output
    leaked = [p for p in out.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert not leaked, leaked
    for repo_id in (REPO, AFTER_THE_FACT):
        assert not [p for p, data in repo_files(hub, repo_id).items() if TOKEN.encode() in data]


@pytest.mark.parametrize("strategy", ["end", "every_save", "all_checkpoints"])
def test_each_hub_strategy_pushes_what_it_says(pushed, tmp_path, monkeypatch, strategy):
    """The other hub strategies, driven in-process on copies of the reference run's checkpoints."""
    import shutil
    from types import SimpleNamespace

    import huggingface_hub.constants

    from hftk.config.options import load_config
    from hftk.publish.hub import RunPusher

    out, _, hub, _ = pushed
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.base_url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    repo = f"hftk-test/strategy-{strategy.replace('_', '-')}"
    run_dir = tmp_path / "run"
    whole, sharded = run_dir / "checkpoint-10", run_dir / "checkpoint-15"
    shutil.copytree(out / "checkpoint-10", whole)
    shutil.copytree(out / "checkpoint-15", sharded)
    (sharded / "model.safetensors").unlink()  # as a sharded strategy's checkpoint: no consolidated weights
    cfg = load_config([*TINY_ARGS, "--output_dir", str(run_dir), "--hub_retry_backoff_s", "0.1"])
    args = SimpleNamespace(hub_model_id=repo, hub_strategy=strategy, output_dir=str(run_dir), hub_private_repo=None,
                           **{k: 1 for k in ("learning_rate", "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size",
                                             "gradient_accumulation_steps", "num_train_epochs", "max_steps", "optim",
                                             "weight_decay", "max_grad_norm", "bf16", "fp16", "seed")})
    pusher = RunPusher(cfg, args, world_size=2, data_format="text", metrics_path=run_dir / "metrics.jsonl")
    pusher.checkpoint_published(whole)
    pusher.checkpoint_published(sharded)
    pusher.pusher.wait()
    reported = metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    outcomes = {m["hub_target"]: m["hub_push"] for m in reported if "hub_push" in m}
    files = set(repo_files(hub, repo)) if repo in hub.state.repos else set()
    model = {"model.safetensors", "config.json", CARD_FILE, RUN_FILE}
    if strategy == "end":  # checkpoints stay home: only the final folder is pushed, at the end
        assert outcomes == {} and files == set()
    elif strategy == "every_save":  # the model files of each save; a checkpoint without weights is reported
        assert outcomes == {"checkpoint-10": "ok", "checkpoint-15": "skipped"}
        assert model <= files and not any("/" in f for f in files)
        assert "optimizer steps: 10" in repo_files(hub, repo)[CARD_FILE].decode()
    else:  # every checkpoint whole, in its own folder
        assert outcomes == {"checkpoint-10": "ok", "checkpoint-15": "ok"}
        assert {"checkpoint-10/optimizer.pt", "checkpoint-15/optimizer.pt", "checkpoint-15/rng_state_1.pth"} <= files
    assert not (run_dir / ".hub-upload").exists() or not any((run_dir / ".hub-upload").iterdir())
