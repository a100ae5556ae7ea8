"""``hftk bench {scaling,batch,overhead,memory,comm,pipeline,data,startup,moe,all} [options] [-- hftk train options]``.

Each sub-bench's options come from its ``run_<name>_bench`` signature (name, default, type), so a
bench module needs no CLI code of its own. ``all`` runs every bench into one report folder with
defaults sized to finish in under 15 minutes on a 2-core CPU; ``--model``, ``--block_size``,
``--nproc`` and ``--timeout`` apply to every bench that takes them, and ``--set NAME.OPTION=VALUE``
sets any one bench's option.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from hftk.core.errors import HftkError

BENCHES = ("scaling", "memory", "comm", "pipeline", "batch", "overhead", "data", "startup", "moe")
SHARED = ("model", "block_size", "nproc", "timeout")
# `hftk bench all` on its defaults must finish in < 15 min on the 2-core CPU machine; these
# override single-bench defaults where the full versions would not fit.
ALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "overhead": {"repeats": 3, "steps": 12},
    "batch": {"max_micro_batch": 32, "global_batch": 32},
    "data": {"examples": 300},
    "moe": {"implementations": ["eager"]},  # batched_mm's row (the slowest by far) only in `hftk bench moe`
}
# Help of the options several benches share; a bench's OPTION_HELP adds its own (and may reword these).
COMMON_HELP = {"model": "model to train (hftk train --model_name_or_path)", "block_size": "tokens per sequence",
               "learning_rate": "constant learning rate", "micro_batch": "sequences per rank per step",
               "timeout": "seconds before a launch is killed"}


def bench_function(name: str) -> Callable[..., dict[str, Any]]:
    """``run_<name>_bench`` from ``hftk.bench.<name>``; a clear error when that module is absent."""
    try:
        module = importlib.import_module(f"hftk.bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"hftk.bench.{name}":
            raise
        raise HftkError("bench", f"'{name}' is not available in this installation (no hftk/bench/{name}.py).",
                        f"run one of the benches that exist: {', '.join(available())}.") from None
    return getattr(module, f"run_{name}_bench")


def available() -> list[str]:
    return [b for b in BENCHES if (Path(__file__).parent / f"{b}.py").exists()]


def options(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The keyword options of a bench function (everything but out_dir and train_args)."""
    params = inspect.signature(fn).parameters
    return {k: p for k, p in params.items() if k not in ("out_dir", "train_args") and p.default is not inspect.Parameter.empty}


def converter(param: inspect.Parameter) -> Callable[[str], Any]:
    """Parse a command-line string by the parameter's annotation or default."""
    hint = str(param.annotation)
    if hint.startswith("list[int]"):
        return lambda s: [int(x) for x in s.split(",") if x]
    if hint.startswith(("list[str]", "tuple[str")):
        return lambda s: [x for x in s.split(",") if x]
    if hint.startswith("bool"):
        return lambda s: s.lower() in ("1", "true", "yes")
    for kind in (int, float, str):
        if hint.startswith(kind.__name__) or type(param.default) is kind:
            return kind
    return _literal


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def default_out(name: str) -> Path:
    return Path("outputs") / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def single_parser(name: str) -> argparse.ArgumentParser:
    """``hftk bench NAME``'s options, read from ``run_<name>_bench``'s signature."""
    fn = bench_function(name)
    parser = _parser(name, (fn.__doc__ or "").strip(), "NAME")
    helps = {**COMMON_HELP, **getattr(sys.modules[fn.__module__], "OPTION_HELP", {})}
    for key, param in options(fn).items():
        flag = {"nargs": "?", "const": True} if str(param.annotation).startswith("bool") else {}  # bare --flag: true
        parser.add_argument(f"--{key}", type=converter(param), default=param.default, **flag,
                            help=helps.get(key, key) + ("" if param.default is None else f" (default: {param.default})"))
    return parser


def parse_single(name: str, argv: list[str]) -> tuple[Path, dict[str, Any]]:
    kwargs = vars(_parse(single_parser(name), argv))
    return kwargs.pop("out") or default_out(name), kwargs


def _parser(name: str, description: str, out_name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"hftk bench {name}", description=description,
                                     epilog="Options after -- go to every training run (hftk train options).",
                                     exit_on_error=False)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Report folder (default outputs/bench/{out_name}-TIME).")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise HftkError(exc.argument_name or "option", f"{exc.message}.", f"see `{parser.prog} --help`.") from None
    if unknown:
        raise HftkError(unknown[0], "is not an option of this bench.", f"see `{parser.prog} --help`; "
                        "hftk train options go after --.")
    return ns


def all_parser() -> argparse.ArgumentParser:
    """``hftk bench all``'s options."""
    parser = _parser("all", "Run every bench into one report folder.", "all")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(BENCHES),
                        help=f"Comma-separated subset of {','.join(BENCHES)}.")
    for key in SHARED:
        parser.add_argument(f"--{key}", type=_literal, default=None, help="Applied to every bench that takes it.")
    parser.add_argument("--set", action="append", default=[], metavar="NAME.OPTION=VALUE",
                        help="One bench's option, e.g. --set scaling.repeats=5 (repeatable).")
    return parser


def build_parsers() -> list[argparse.ArgumentParser]:
    """Every ``hftk bench`` parser, ``all`` first (the documentation's command reference renders them)."""
    return [all_parser(), *(single_parser(name) for name in available())]


def parse_all(argv: list[str]) -> tuple[Path, dict[str, dict[str, Any]]]:
    ns = _parse(all_parser(), argv)
    if unknown := [b for b in ns.only if b not in BENCHES]:
        raise HftkError("--only", f"unknown bench '{unknown[0]}'.", f"use names from {', '.join(BENCHES)}.")
    shared = {k: getattr(ns, k) for k in SHARED if getattr(ns, k) is not None}
    per_bench: dict[str, dict[str, Any]] = {b: {**ALL_DEFAULTS.get(b, {}), **shared} for b in ns.only}
    for item in ns.set:
        target, _, value = item.partition("=")
        bench, _, key = target.partition(".")
        if bench not in per_bench or not key or not value:
            raise HftkError("--set", f"'{item}' is not NAME.OPTION=VALUE for a bench in this run.",
                            "write e.g. --set scaling.repeats=5.")
        per_bench[bench][key] = value
    return ns.out or default_out("all"), per_bench


def resolve(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """Keep the options ``name`` takes (shared ones it lacks are dropped), converted to its types."""
    opts = options(bench_function(name))
    kwargs = {}
    for key, value in given.items():
        if key not in opts:
            if key in SHARED:
                continue
            raise HftkError(f"--set {name}.{key}", "is not an option of this bench.",
                            f"use one of: {', '.join(opts)}.")
        kwargs[key] = converter(opts[key])(value) if isinstance(value, str) else value
    return kwargs


def run_benches(out: Path, plan: dict[str, dict[str, Any]], train_args: list[str], command: str) -> int:
    """Run each bench into ``out/<name>``, then write the report; a failing bench is reported, not fatal."""
    from hftk.bench.launch import Machine
    from hftk.bench.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    machine, started = Machine.here(), time.time()
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for name, kwargs in plan.items():
        print(f"hftk bench: {name} ...", flush=True)
        t0 = time.time()
        try:
            fn = bench_function(name)
            extra = {"train_args": train_args} if "train_args" in inspect.signature(fn).parameters else {}
            if train_args and not extra:
                print(f"hftk bench: {name} takes no hftk train options; it runs without {' '.join(train_args)}",
                      flush=True)
            results[name] = fn(out / name, **extra, **kwargs)
        except HftkError as exc:
            failures[name] = exc.one_line()
        except Exception:  # a bench that crashed still leaves the others' figures and a report
            failures[name] = traceback.format_exc()
        print(f"hftk bench: {name} {'FAILED' if name in failures else 'done'} in {time.time() - t0:.0f}s", flush=True)
    print(f"hftk bench: report {write_report(out, results, machine, started, command, failures)}", flush=True)
    for name, error in failures.items():
        print(f"hftk bench: {name} failed: {error.strip().splitlines()[-1]}", file=sys.stderr)
    return 1 if failures else 0


def bench_command(argv: list[str]) -> int:
    """Entry point of ``hftk bench``: every option is checked before the first launch."""
    i = argv.index("--") if "--" in argv else len(argv)
    own, train_args = argv[:i], argv[i + 1:]
    if not own or own[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nbenches: {', '.join(BENCHES)}, all (available here: {', '.join(available())})")
        return 0
    name, rest = own[0], own[1:]
    if name == "all":
        out, plan = parse_all(rest)
    elif name in BENCHES:
        out, kwargs = parse_single(name, rest)
        plan = {name: kwargs}
    else:
        raise HftkError("bench", f"unknown bench '{name}'.", f"use one of: {', '.join(BENCHES)}, all.")
    if train_args:  # unknown hftk train options fail here, in one line, before any worker starts
        from hftk.config.options import load_config

        load_config(train_args)
    for bench in available():  # an unavailable one is reported by run_benches, after the others ran
        if bench in plan:
            plan[bench] = resolve(bench, plan[bench])
            module = sys.modules[bench_function(bench).__module__]
            getattr(module, "check_options", lambda **_: None)(**plan[bench])
    return run_benches(out, plan, train_args, "hftk bench " + " ".join(argv))
