"""A standard Hugging Face folder: reading its safetensors, rebuilding a model from a config and
a state dict, writing a folder atomically, and proving every weight is in it.

A leaf module: the savers of every strategy, LoRA and the custom loop check their folders with
:func:`check_complete`, and ``hftk export`` writes through it, without importing one another.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hftk.core.errors import HftkError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"

Shapes = list[tuple[list[str], tuple[int, ...]]]  # per parameter: all its names (tied weights), full shape


def has_safetensors(path: Path) -> bool:
    return (path / SAFE_WEIGHTS).is_file() or (path / SAFE_INDEX).is_file()


def safetensors_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights saved whole by ``save_pretrained`` (DDP, or any strategy's gathered save), sharded or not."""
    return {k: v for f in _safetensors_files(path) for k, v in load_file(str(f)).items()}


def _safetensors_files(path: Path) -> list[Path]:
    if (path / SAFE_INDEX).is_file():
        index = json.loads((path / SAFE_INDEX).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    return [path / SAFE_WEIGHTS]


T = TypeVar("T")


def write_atomically(out: Path, write: Callable[[Path], T]) -> T:
    """``write`` fills a temporary sibling of ``out``, renamed to ``out`` (absent or empty) once complete;
    returns what it returns. ``out`` is never half-written: exports, preprocessed data."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        result = write(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def model_from(config: Any, state: dict[str, torch.Tensor], source: Path, runnable: bool = False) -> torch.nn.Module:
    """``config``'s architecture (the family's own class) holding ``state`` read from ``source``; built on
    the meta device (no random init), tied weights re-tied. ``runnable``: built on the CPU instead (random
    init skipped by transformers' ``no_init_weights``), so non-persistent buffers such as RoPE's ``inv_freq``,
    which no checkpoint holds, are real and the model can run forward (``hftk generate``)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights() if runnable else torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    loaded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in state}
    still_missing = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) not in loaded]
    if unexpected or still_missing:
        raise HftkError("CHECKPOINT", f"'{source}' does not match its config.json: missing "
                        f"{still_missing[:5]}, unexpected {unexpected[:5]}.",
                        "pass the checkpoint folder the Trainer wrote, unmodified.")
    return model


def read_dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model saved by ``dcp.save({"model": ...})`` in ``folder``, read from every rank's shard
    files in this one process (no process group): empty tensors of the recorded shapes and dtypes,
    filled by ``dcp.load(no_dist=True)``. Keys as the model names them (the ``model.`` prefix dropped)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": exactly the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def shapes_of(model: torch.nn.Module, original_format: bool = True) -> Shapes:
    """Per tensor ``save_pretrained`` writes: every name it may go by and its full shape.

    ``original_format`` (``save_pretrained``'s ``save_original_format``, its default): the tensors as
    transformers writes them, by its own revert of the conversions it applies at load
    (``revert_weight_conversion``): renamed keys (GPT-NeoX's ``lm_head.weight`` as ``embed_out.weight``)
    and fused experts split back per expert (Qwen3-MoE's ``mlp.experts.gate_up_proj [E, 2I, H]`` as
    ``mlp.experts.{e}.gate_proj.weight [I, H]`` and ``up_proj``), reverted for the whole model at once
    as ``save_pretrained`` does (a many-to-one conversion needs every piece). Otherwise the live names
    and shapes. A tied weight is saved once, under any of its names. ZeRO-3 partitioned parameters
    report their full shape in ``ds_shape``.
    """
    from transformers.modeling_utils import revert_weight_conversion

    groups: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
        groups.setdefault(id(param), ([], shape))[0].append(name)
    if not original_format:
        return list(groups.values())

    def saved(tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        meta = {name: torch.empty(shape, device="meta") for name, shape in tensors.items()}
        return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, meta).items()}

    written = saved({names[0]: shape for names, shape in groups.values()})
    expected = {name: [name] for name in written}
    for names, shape in groups.values():
        if len(names) > 1:  # tied: one tensor (a plain weight, renamed at most), under whichever name is kept
            aliases = list(dict.fromkeys(key for name in names for key in saved({name: shape})))
            for key in saved({names[0]: shape}):
                expected[key] = aliases
    return [(names, written[key]) for key, names in expected.items()]


def check_complete(folder: Path, expected: Shapes) -> None:
    """Every parameter is saved under one of its names with its full shape (reads headers only).

    Empty or partial final weights after sharded training are the field's most reported
    failure; this turns them into an error at save time instead of at someone's load time.
    """
    folder = Path(folder)
    saved: dict[str, tuple[int, ...]] = {}
    for f in _safetensors_files(folder):
        if not f.is_file():
            raise HftkError("output", f"{folder} has no {f.name}.", "rerun the save; check free disk space.")
        with safe_open(str(f), framework="pt") as handle:
            saved.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
    for names, shape in expected:
        if not any(saved.get(n) == shape for n in names):
            got = {n: saved[n] for n in names if n in saved}
            raise HftkError("output", f"{folder} lacks {names[0]} {list(shape)} (saved: {got or 'nothing'}).",
                            "the weights were not gathered before saving; report this with the strategy used.")
