"""``hftk generate``: see what a checkpoint says, without exporting it first.

Any folder ``hftk export`` reads (a final folder, a checkpoint-N of any strategy, a LoRA / QLoRA adapter),
or a Hub model id (downloaded with huggingface_hub's ``snapshot_download``), is loaded through the same readers (:func:`hftk.publish.export.detect`, :func:`hftk.models.lora.merged_model`)
and handed to transformers' own ``generate`` with a ``GenerationConfig``; tokens stream through ``TextStreamer``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hftk.core.errors import HftkError
from hftk.models import lora


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def local_folder(checkpoint: Path | str) -> Path:
    """The folder to read: ``checkpoint`` itself, or a Hub model id downloaded into the Hub cache."""
    checkpoint = Path(checkpoint)
    if checkpoint.exists():
        return checkpoint
    if not HUB_ID.fullmatch(str(checkpoint)):
        raise HftkError("CHECKPOINT", f"'{checkpoint}' does not exist.",
                        "pass a final or checkpoint-N folder of a run, or a Hub model id (user/name).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from hftk.publish.hub import MODEL_PATTERNS

    try:  # the model files at the repo's root: not a pushed last-checkpoint/ or its optimizer state
        return Path(snapshot_download(str(checkpoint), allow_patterns=list(MODEL_PATTERNS), ignore_patterns=["*/*"]))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise HftkError("CHECKPOINT", f"'{checkpoint}' is no local folder, and the Hub did not give it "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0]}).",
                        "pass a run's folder, or check the model id, HF_TOKEN and the network.") from None


def load(checkpoint: Path | str) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from any checkpoint folder hftk can export, or a Hub model id."""
    from transformers import AutoConfig, AutoTokenizer

    from hftk.checkpoint.hf_folder import model_from
    from hftk.publish.export import detect

    checkpoint = local_folder(checkpoint)
    if lora.is_adapter_folder(checkpoint):
        model = lora.merged_model(checkpoint, None)
    else:
        kind = detect(checkpoint)
        if not (checkpoint / "config.json").is_file():
            raise HftkError("CHECKPOINT", f"'{checkpoint}' has no config.json: the model cannot be rebuilt.",
                            "pass a checkpoint written by the Trainer (it saves the config beside the weights).")
        model = model_from(AutoConfig.from_pretrained(checkpoint), kind.state_dict(checkpoint), checkpoint,
                           runnable=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise HftkError("CHECKPOINT", f"'{checkpoint}' has no loadable tokenizer ({str(exc).splitlines()[0]}).",
                        "copy the run's tokenizer files into the checkpoint folder.") from None
    return model.eval(), tokenizer


def read_prompts(path: Path, field: str = "--prompts") -> list[str | list[dict[str, str]]]:
    """Rows of a JSONL file: each a ``prompt`` string or a ``messages`` list of {role, content} strings; a bad row
    is one error line naming ``field`` (the option that gave the file), the row and what is wrong in it."""
    if not Path(path).is_file():
        raise HftkError(field, f"'{path}' is not a file.", "pass a JSONL file of {\"prompt\": ...} rows.")
    prompts: list[str | list[dict[str, str]]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            bad = next((i for i, turn in enumerate(row["messages"]) if not isinstance(turn, dict)
                        or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str)), None)
            if bad is not None or not row["messages"]:
                where = f"messages[{bad}] is not a {{\"role\": str, \"content\": str}} turn" if bad is not None \
                    else "messages is empty"
                raise HftkError(field, f"row {number} of '{path}': {where}.", "fix or remove that row.")
            prompts.append(row["messages"])
        else:
            raise HftkError(field, f"row {number} of '{path}' is not a {{\"prompt\": str}} or "
                            "{\"messages\": [...]} JSON object.", "fix or remove that row.")
    if not prompts:
        raise HftkError(field, f"'{path}' holds no rows.", "add one {\"prompt\": ...} row per line.")
    return prompts


def input_ids(tokenizer: Any, prompt: str | list[dict[str, str]], field: str = "--prompts") -> torch.Tensor:
    """A prompt's ids: plain text as is, a message list through the tokenizer's (the run's, the checkpoint's saved)
    chat template, with the generation prompt that opens the assistant's turn."""
    if isinstance(prompt, str):
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not tokenizer.chat_template:
        raise HftkError(field, "a messages row needs a chat template, and the tokenizer has none.",
                        "use {\"prompt\": ...} rows, or pass --chat_template (a chat run).")
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def generation_config(model: Any, tokenizer: Any, max_new_tokens: int, do_sample: bool, temperature: float,
                      top_p: float) -> Any:
    """A ``GenerationConfig``: the model's own (its EOS, pad, ...) with these options; greedy unless ``do_sample``;
    pad falls back to the tokenizer's pad, then EOS (as ``generate`` would, without its warning)."""
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    config = GenerationConfig.from_model_config(model.config) if own is None else GenerationConfig(**own.to_dict())
    config.update(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature if do_sample else None,
                  top_p=top_p if do_sample else None)
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id
    return config


def generate(model: Any, tokenizer: Any, prompt: str | list[dict[str, str]], config: Any, stream: bool = False,
             synced_gpus: bool = False, device: Any = None, stopping_criteria: Any = None) -> torch.Tensor:
    """The new token ids for one prompt (greedy unless ``config`` samples); streamed to stdout if asked.
    ``synced_gpus``: every rank of a sharded model calls this in lock-step (ranks that stop early keep
    running forwards until all have stopped, transformers' own mechanism); ``stopping_criteria``: transformers'
    ``StoppingCriteriaList``, checked after every token."""
    from transformers import TextStreamer

    ids = input_ids(tokenizer, prompt).to(device or "cpu")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer,
                             synced_gpus=synced_gpus, stopping_criteria=stopping_criteria)
    return out[0, ids.shape[1]:]


def chat(model: Any, tokenizer: Any, config: Any, lines: Iterable[str], system: str | None = None) -> list[dict]:
    """Each line a user turn, answered with the conversation so far through the saved chat template; an
    empty line or the end of input stops. Returns the conversation."""
    if not tokenizer.chat_template:
        raise HftkError("--chat", "this checkpoint's tokenizer has no chat template.",
                        "use --prompt, or a checkpoint of a run trained with --chat_template.")
    messages = [{"role": "system", "content": system}] if system else []
    for line in lines:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = generate(model, tokenizer, messages, config, stream=True)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
    return messages


def _typed_lines() -> Iterable[str]:
    """stdin's lines, with a ``> `` prompt on stderr when a person types them."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def build_parser() -> argparse.ArgumentParser:
    """``hftk generate``'s options (also rendered on the documentation's command reference)."""
    parser = argparse.ArgumentParser(
        prog="hftk generate",
        description="Generate from any checkpoint hftk writes (final, checkpoint-N of any strategy, LoRA / QLoRA "
        "adapter) without exporting first; greedy unless --do_sample; tokens stream as they come.")
    parser.add_argument("checkpoint", help="a final or checkpoint-N folder (or an adapter folder), or a Hub model id")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt, as plain text")
    source.add_argument("--prompts", type=Path, help="JSONL file: {\"prompt\": str} or {\"messages\": [...]} rows")
    source.add_argument("--chat", action="store_true",
                        help="talk to it: each stdin line a user turn, the conversation kept, the saved chat "
                        "template applied; an empty line or end of input stops")
    parser.add_argument("--system", help="with --chat: a system message opening the conversation")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="most new tokens per prompt")
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do_sample)")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (with --do_sample)")
    return parser


def main(argv: list[str]) -> int:
    """``hftk generate CHECKPOINT (--prompt TEXT | --prompts FILE | --chat) [GenerationConfig options]``."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise HftkError("--max_new_tokens", f"must be at least 1, got {args.max_new_tokens}.", "pass 1 or more.")
    if args.system is not None and not args.chat:
        raise HftkError("--system", "is for --chat.", "add --chat, or put the system message in a messages row.")
    prompts = [] if args.chat else [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    model, tokenizer = load(args.checkpoint)
    config = generation_config(model, tokenizer, args.max_new_tokens, args.do_sample, args.temperature, args.top_p)
    if args.chat:
        chat(model, tokenizer, config, _typed_lines(), args.system)
        return 0
    for prompt in prompts:
        generate(model, tokenizer, prompt, config, stream=True)
    return 0
