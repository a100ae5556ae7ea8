"""``hftk bench data``: what each ``data.packing`` mode costs and buys on variable-length examples.

The bench writes an instruction set (prompt / completion pairs cut from the shipped corpus, lengths
log-uniform over a >= 10x spread) and trains one epoch of it per mode through hftk's engine (DDP on
``nproc`` ranks): ``concat`` (cross-example blocks), ``bfd`` (packed apart, padding-free),
``none`` (each batch padded to its longest) and ``pad-to-block`` (``none`` with
``pad_to_multiple_of = block_size``: every row padded to the block, the old one-example-per-block
layout). One epoch is the fixed token budget: every mode sees every training example once.

Equal tokens are not enough for a fair held-out loss: a packed row carries several examples, so at
the same rows per step bfd takes a third of the optimizer steps of the padded modes. The packed
modes (``concat``, ``bfd``) take ``micro_batch`` rows per rank; the one-example-per-row modes
(``none``, ``pad-to-block``) take as many rows as a bfd batch holds examples (counted on the run's
own bfd packing, before launch), so every mode takes about the same optimizer steps with about the
same examples in each. That way round because rows of ~3 examples cannot match a small padded
batch closely (4 examples: 1 or 2 bfd rows, 1.4x apart in steps either way).

Per mode: useful (labelled) tokens per second of training wall time, the share of computed tokens
that are padding (counted on the very batches the collator built), peak memory per rank (the run's
own monitor, max over ranks), optimizer steps, and the held-out loss after the epoch. Prompt /
completion pairs rather than chat turns, because ``concat`` refuses conversations.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, DEFAULT_MODEL, run_workers, threads_per_rank
from hftk.core.errors import HftkError

MODES = {"concat": ["--packing", "concat"], "bfd": ["--packing", "bfd"], "none": ["--packing", "none"],
         "pad-to-block": ["--packing", "none", "--pad_to_multiple_of", "{block_size}"]}
PACKED = ("concat", "bfd")  # several examples per row: micro_batch rows; the others one example per row

OPTION_HELP = {
    "nproc": "DDP processes of every run",
    "block_size": "tokens per block (bfd / concat) and the pad-to-block length",
    "micro_batch": "packed rows per rank per step (concat, bfd); the padded modes take as many rows as give bfd's step count",
    "examples": "prompt / completion pairs the bench writes (a tenth held out)",
    "min_words": "shortest example, in corpus words",
    "max_words": "longest example, in corpus words (>= 10x min_words)",
}


def check_options(min_words: int, max_words: int, **_: Any) -> None:
    if max_words < 10 * min_words:
        raise HftkError("--max_words", f"{max_words} is less than 10x min_words ({min_words}).",
                        "spread the lengths at least 10x (what the bench is about).")


def write_examples(path: Path, n: int, min_words: int, max_words: int, seed: int = 0) -> dict[str, Any]:
    """``n`` prompt / completion pairs of log-uniform length cut from the shipped corpus; their word counts."""
    from hftk.data.builtin import BUILTIN_DATASETS

    words = Path(BUILTIN_DATASETS["kjv"]).read_text().split()
    rng = random.Random(seed)
    lengths, rows = [], []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(min_words), math.log(max_words))))
        start = rng.randrange(len(words) - length)
        cut = max(1, length // 4)
        rows.append({"prompt": " ".join(words[start:start + cut]),
                     "completion": " " + " ".join(words[start + cut:start + length])})
        lengths.append(length)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"examples": n, "words_min": min(lengths), "words_max": max(lengths), "words_mean": sum(lengths) / n}


def run_data_bench(out_dir: Path, nproc: int = 2, model: str = DEFAULT_MODEL, block_size: int = 256,
                   micro_batch: int = 4, examples: int = 600, min_words: int = 12, max_words: int = 180,
                   learning_rate: float = 1e-3, train_args: list[str] | None = None,
                   timeout: float = 900) -> dict[str, Any]:
    """One epoch per packing mode; ``bfd_vs_pad_to_block`` is the useful-token throughput ratio."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = out_dir / "examples.jsonl"
    data = write_examples(dataset, examples, min_words, max_words)
    threads = threads_per_rank(nproc)
    # BENCH_TRAIN_ARGS logs every step: peak memory per window
    base = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--dataset", str(dataset), "--eval_fraction", "0.1",
            "--block_size", str(block_size), "--per_device_eval_batch_size", str(micro_batch),
            "--num_train_epochs", "1", "--learning_rate", str(learning_rate), "--model_dropout", "0"]
    bfd = bfd_packing([*base, *MODES["bfd"], *(train_args or []), "--output_dir", str(out_dir / "bfd" / "run")])
    padded_rows = padded_rows_per_rank(bfd, nproc, micro_batch)
    runs = {}
    for mode, extra in MODES.items():  # rows per rank are the bench's own, after any train_args
        work = out_dir / mode
        rows_per_rank = micro_batch if mode in PACKED else padded_rows
        argv = [*base, *[a.format(block_size=block_size) for a in extra], *(train_args or []),
                "--per_device_train_batch_size", str(rows_per_rank), "--output_dir", str(work / "run")]
        launch = run_workers(nproc, {"mode": "trainer", "argv": argv}, work, timeout, threads)
        runs[mode] = {"rows_per_rank": rows_per_rank, **summarise(launch.ranks)}
        runs[mode]["examples_per_step"] = bfd["train_examples"] / runs[mode]["steps"]
        runs[mode]["loadavg"] = [launch.loadavg_before[0], launch.loadavg_after[0]]
    result: dict[str, Any] = {
        "nproc": nproc, "model": model, "block_size": block_size, "micro_batch_per_rank": micro_batch,
        "padded_rows_per_rank": padded_rows, "bfd_examples_per_row": bfd["examples_per_row"],
        "threads_per_rank": threads, "data": data, "modes": runs,
        "bfd_vs_pad_to_block": runs["bfd"]["useful_tokens_per_s"] / runs["pad-to-block"]["useful_tokens_per_s"],
        "bfd_eval_loss_vs_pad_to_block": runs["bfd"]["eval_loss"] / runs["pad-to-block"]["eval_loss"] - 1,
    }
    return finish(result, table, chart, out_dir / "data.png")


def padded_rows_per_rank(bfd: dict[str, Any], nproc: int, micro_batch: int) -> int:
    """Rows per rank that give the one-example-per-row modes as many optimizer steps as bfd's epoch
    (the fewest such rows, so about as many examples per step): at equal tokens, a different step
    count or a short extra last step would move the held-out loss by itself."""
    steps = math.ceil(bfd["train_rows"] / (nproc * micro_batch))
    return math.ceil(bfd["train_examples"] / (nproc * steps))


def bfd_packing(argv: list[str]) -> dict[str, Any]:
    """Training examples and examples per row of the bfd run ``argv``, packed here as the run packs
    them (``hftk.data.dataset``: the same tokenisation, split seed and TRL best-fit decreasing)."""
    from hftk.data.dataset import tokenize_sources
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare

    p = prepare(argv)
    tokenizer = load_tokenizer(p.cfg.model, p.cfg.data.chat_template, p.cfg.data.add_chat_tokens)
    train = tokenize_sources(p.sources, tokenizer, p.cfg.args.seed).train
    examples = sum(len(lengths) for lengths in train["seq_lengths"])
    return {"train_examples": examples, "train_rows": len(train), "examples_per_row": examples / len(train)}


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Token counts summed over ranks; wall time = per step the slowest rank, summed over the epoch."""
    counts = {k: sum(r["tokens"][k] for r in ranks) for k in ("computed", "real", "labelled")}
    wall = sum(max(r["steps"][i]["wall_s"] for r in ranks) for i in range(len(ranks[0]["steps"])))
    return {**counts, "steps": len(ranks[0]["steps"]), "train_s": wall,
            "useful_tokens_per_s": counts["labelled"] / wall, "computed_tokens_per_s": counts["computed"] / wall,
            "padding_share": 1 - counts["real"] / counts["computed"], "peak_mem_mb": ranks[0]["peak_mem_mb"],
            "eval_loss": ranks[0]["eval_loss"]}


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = [[mode, f"{r['useful_tokens_per_s']:.0f}", f"{r['padding_share']:.1%}", f"{r['computed']}",
             f"{r['rows_per_rank']}", f"{r['steps']}", f"{r['examples_per_step']:.1f}", f"{r['train_s']:.1f}",
             f"{r['peak_mem_mb']:.0f}", f"{r['eval_loss']:.4f}"]
            for mode, r in result["modes"].items()]
    d = result["data"]
    return {"title": f"Packing modes, one epoch of {d['examples']} prompt/completion pairs ({d['words_min']}-"
                     f"{d['words_max']} words), block {result['block_size']}, {result['nproc']} DDP ranks, packed rows "
                     f"({result['bfd_examples_per_row']:.2f} examples each, bfd), {result['padded_rows_per_rank']} padded rows: equal steps; bfd / "
                     f"pad-to-block useful tokens/s = {result['bfd_vs_pad_to_block']:.2f}x, held-out loss "
                     f"{result['bfd_eval_loss_vs_pad_to_block']:+.1%}; one launch per mode",
            "columns": ["packing", "useful tokens/s", "padding share", "tokens computed", "rows / rank", "steps",
                        "examples / step", "train s", "peak MiB / rank", "held-out loss"], "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    modes = list(result["modes"])
    fig, (speed, pad, loss) = figure(3, f"Packing modes ({result['nproc']} ranks, block {result['block_size']})")
    for ax, key, label in ((speed, "useful_tokens_per_s", "useful (label) tokens / s"),
                           (pad, "padding_share", "padding share of compute"), (loss, "eval_loss", "held-out loss")):
        ax.bar(modes, [result["modes"][m][key] for m in modes], color=["tab:gray", "tab:green", "tab:blue", "tab:red"])
        ax.set(ylabel=label)
        ax.tick_params(axis="x", labelrotation=20)
    return save(fig, path)
