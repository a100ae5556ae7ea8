"""Launch configs in one process (hftk.launch.configs): committed files equal the generator, accelerate reads every
YAML as two ranks with hftk's strategy, the launcher's strategy becomes the default, contradictions fail
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hftk.core.errors import HftkError
from hftk.launch.configs import (DEEPSPEED_STRATEGIES, LAUNCH_STRATEGIES, adopt_launcher_strategy, launcher_strategy,
                                 render_all)
from tests.helpers import ROOT

CONFIGS = ROOT / "accelerate_configs"


def test_committed_configs_are_exactly_what_the_generator_writes():
    expected = render_all(Path("accelerate_configs"))
    on_disk = {p.relative_to(ROOT) for p in CONFIGS.rglob("*") if p.is_file()}
    assert on_disk == set(expected), "run `hftk configs` and commit the result"
    for path, text in expected.items():
        assert (ROOT / path).read_text() == text, f"{path} differs from `hftk configs`; regenerate it"


def _accelerate_view(path: Path):
    """The config as accelerate's own loader reads it, and the environment its launcher gives the script."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        cmd, env = prepare_deepspeed_cmd_env(args)
        assert cmd is None, cmd  # None: accelerate runs torchrun itself, not the deepspeed / pdsh launcher
    else:
        env = prepare_multi_gpu_env(args)
    return args, defaults, env


@pytest.mark.parametrize("strategy", LAUNCH_STRATEGIES)
def test_yaml_fields_start_two_real_ranks_on_cpu_and_gpu(strategy, monkeypatch):
    monkeypatch.chdir(ROOT)  # the DeepSpeed JSON paths are relative to the repository root
    args, defaults, env = _accelerate_view(CONFIGS / f"{strategy}.yaml")
    assert defaults.num_processes == 2 and defaults.num_machines == 1
    assert not args.cpu and not defaults.use_cpu  # either would start ONE process on CPU
    kind = defaults.distributed_type.value
    plain = ("ddp", "pipeline", "tp", "cp", "sp", "ep")  # the strategy comes from --strategy, not from the launch
    assert kind == ("FSDP" if strategy == "fsdp" else "MULTI_GPU" if strategy in plain else "DEEPSPEED")
    assert kind != "MULTI_CPU"
    found = launcher_strategy(env)
    assert (found[0] if found else None) == (None if strategy in plain else strategy)
    if strategy in DEEPSPEED_STRATEGIES:
        ds = json.loads(Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())
        assert ds["zero_optimization"]["stage"] == int(strategy[4])
        assert ds["gradient_clipping"] == 1.0  # explicit: DeepSpeed's silent default must not decide
        assert defaults.mixed_precision is None  # accelerate refuses it beside a deepspeed_config_file
    if strategy == "fsdp":
        assert env["FSDP_VERSION"] == "2"


# ---- the strategy a launch config asks for, reconciled with --strategy ----

def _cfg(*argv: str):
    from hftk.config.options import load_config

    return load_config(list(argv))


def _deepspeed_env(strategy: str) -> dict[str, str]:
    return {"ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS / "deepspeed" / f"{strategy}.json")}


FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "false",
            "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}


@pytest.mark.parametrize("strategy", DEEPSPEED_STRATEGIES)
def test_launch_config_sets_the_default_strategy(strategy):
    cfg = _cfg()
    assert adopt_launcher_strategy(cfg, _deepspeed_env(strategy)) is not None
    assert cfg.strategy.strategy == strategy
    same = _cfg("--strategy", strategy)
    adopt_launcher_strategy(same, _deepspeed_env(strategy))
    assert same.strategy.strategy == strategy


def test_fsdp_launch_hands_fsdp_to_hftk_and_takes_accelerates_switch_away():
    env = dict(FSDP_ENV)
    cfg = _cfg()
    adopt_launcher_strategy(cfg, env)
    assert cfg.strategy.strategy == "fsdp"
    assert not any(k == "ACCELERATE_USE_FSDP" or k.startswith("FSDP_") for k in env)


def test_plain_launch_leaves_the_strategy_alone():
    cfg = _cfg("--strategy", "auto")
    assert adopt_launcher_strategy(cfg, {"WORLD_SIZE": "2"}) is None
    assert cfg.strategy.strategy == "auto"


def _edited_json(tmp_path: Path) -> dict[str, str]:
    data = json.loads((CONFIGS / "deepspeed" / "zero2.json").read_text())
    data["zero_optimization"]["reduce_bucket_size"] = 500000000
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}


CONFLICTS = [
    ("other_strategy", ("--strategy", "zero1"), lambda tmp: _deepspeed_env("zero3"), "strategy.strategy"),
    ("auto_with_fixed_launch", ("--strategy", "auto"), lambda tmp: _deepspeed_env("zero2"), "strategy.strategy"),
    ("edited_deepspeed_json", (), _edited_json, "launch"),
    ("missing_deepspeed_json", (), lambda tmp: {"ACCELERATE_USE_DEEPSPEED": "true",
                                                "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp / "nope.json")}, "launch"),
    ("fsdp_version_1", (), lambda tmp: {**FSDP_ENV, "FSDP_VERSION": "1"}, "launch"),
    ("fsdp_offload_disagrees", (), lambda tmp: {**FSDP_ENV, "FSDP_OFFLOAD_PARAMS": "true"}, "launch"),
]


@pytest.mark.parametrize("case,argv,env,field", CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_launch_config_contradictions_are_one_line_errors(case, argv, env, field, tmp_path):
    with pytest.raises(HftkError) as err:
        adopt_launcher_strategy(_cfg(*argv), env(tmp_path))
    assert err.value.field == field and "\n" not in err.value.one_line() and err.value.fix
