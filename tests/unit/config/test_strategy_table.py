"""The strategy table (hftk/config/strategy_table.py): every row names a module that answers what its
engine asks, and every list of strategies hftk shows or checks is read from the table."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from hftk.config import strategy_table
from hftk.config.options import STRATEGIES as CLI_CHOICES
from hftk.config.options import StrategyConfig, load_config
from hftk.config.strategy_table import STRATEGIES
from hftk.core.errors import HftkError
from tests.helpers import TINY_ARGS

ENGINE_HOOKS = {  # what each engine calls on a strategy module
    "trainer": ("validate", "training_arguments", "prepare_model", "verify", "save_final"),
    "loop": ("validate", "build_step"),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_row_names_a_module_that_answers_its_engine(name):
    spec = STRATEGIES[name]
    module = strategy_table.get(name)
    missing = [hook for hook in ENGINE_HOOKS[spec.engine] if not callable(getattr(module, hook, None))]
    assert not missing, f"{spec.module} lacks {missing} for engine {spec.engine}"
    assert callable(importlib.import_module(f"hftk.engine.{spec.engine}").train)
    fields = {f.name: f.default for f in dataclasses.fields(StrategyConfig)}
    assert all(fields.get(option) in (1, -1) for option in spec.options), spec.options  # 1, or -1: the whole world


def test_the_cli_the_launch_configs_and_the_checks_list_the_table():
    from hftk.config import support
    from hftk.launch import configs
    from hftk.plan import estimate

    assert CLI_CHOICES == (*STRATEGIES, "auto")
    files = configs.render_all()
    for name, spec in STRATEGIES.items():
        text = files[configs.DEFAULT_OUT / f"{name}.yaml"]
        assert f"distributed_type: {spec.launch}\n" in text and f"# {spec.usage}\n" in text
        if spec.zero_stage is not None:
            zero = json.loads(files[configs.deepspeed_json_path(configs.DEFAULT_OUT, name)])["zero_optimization"]
            assert zero["stage"] == spec.zero_stage and ("offload_param" in zero) == spec.offload
    assert estimate.PLAN_STRATEGIES == ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload")  # least sharding first
    assert support.QUANT_STRATEGIES == tuple(n for n, s in STRATEGIES.items() if s.quantized_base)
    assert all(support.PACKING_SUPPORT[n] == s.packing for n, s in STRATEGIES.items())


def test_a_deepspeed_launch_config_is_read_back_as_its_strategy(tmp_path, monkeypatch):
    from hftk.launch import configs

    for name in configs.DEEPSPEED_STRATEGIES:
        path = configs.deepspeed_json_path(tmp_path, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(configs.deepspeed_json(name)))
        assert configs._deepspeed_strategy({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)})[0] == name


@pytest.mark.parametrize("option, value, strategy, owners", [
    ("--sp_size", "2", "ddp", "sp"),
    ("--pp_size", "2", "fsdp", "pipeline"),
    ("--tp_size", "2", "sp", "tp or cp"),
    ("--dp_shard_size", "-1", "ddp", "tp or cp"),  # FSDP2 under tp / cp only: plain fsdp shards over every rank
    ("--ep_size", "2", "fsdp", "ep"),
])
def test_a_degree_is_refused_under_a_strategy_that_does_not_own_it(option, value, strategy, owners, tmp_path):
    from hftk.run.validate import check_config

    cfg = load_config([*TINY_ARGS, "--strategy", strategy, option, value, "--output_dir", str(tmp_path / "out")])
    with pytest.raises(HftkError) as caught:
        check_config(cfg)
    default = StrategyConfig.__dataclass_fields__[option[2:]].default
    assert caught.value.one_line() == (f"strategy.{option[2:]}: is {value} but strategy {strategy} does not use it. "
                                       f"Fix: pass --strategy {owners}, or leave {option[2:]} at {default}.")


def test_gradient_compression_names_the_strategies_the_table_allows(tmp_path):
    from hftk.comm.register import validate

    cfg = load_config([*TINY_ARGS, "--strategy", "fsdp", "--grad_compression", "fp16",
                       "--output_dir", str(tmp_path / "out")])
    with pytest.raises(HftkError, match="strategy 'fsdp' has none. Fix: use --strategy ddp, or drop"):
        validate(cfg.strategy, 2, {})
