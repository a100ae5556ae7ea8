"""Launch configs: accelerate YAML and DeepSpeed JSON generated from the typed config, and the
launcher's choice read back inside the run.

Every YAML starts its ranks through torchrun (accelerate's MULTI_GPU, FSDP and DEEPSPEED
launchers all do for one machine), the only way that really starts N processes on a CPU-only
machine as on GPUs: ``MULTI_CPU`` and ``--cpu`` silently start one (field notes).

accelerate hands a config's distributed type to the training script only through environment
variables, so that is how a YAML selects hftk's strategy: ``fsdp.yaml`` (``distributed_type:
FSDP``) sets ``ACCELERATE_USE_FSDP`` and the ``zero*.yaml`` files (``DEEPSPEED``) point
``ACCELERATE_DEEPSPEED_CONFIG_FILE`` at their JSON. :func:`adopt_launcher_strategy` reads them
before any process group exists. hftk then applies FSDP2 itself (accelerate's FSDP type silently
becomes DDP on CPU), so it takes accelerate's FSDP switch out of the environment. ``ddp.yaml`` and
``pipeline.yaml`` share the plain MULTI_GPU launch; pipeline needs ``--strategy pipeline``, and
``tp.yaml`` / ``cp.yaml`` / ``sp.yaml`` (the same launch) need ``--strategy tp`` / ``cp`` / ``sp``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import yaml

from hftk.config.strategy_table import DEEPSPEED, STRATEGIES
from hftk.core.errors import HftkError

LAUNCH_STRATEGIES = tuple(STRATEGIES)
DEEPSPEED_STRATEGIES = DEEPSPEED
DEFAULT_OUT = Path("accelerate_configs")
DEFAULT_STRATEGY = "ddp"  # StrategyConfig.strategy's default: a launch config may override it
FSDP_STATE_DICT_TYPES = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}
FSDP_ENV_PREFIX = "FSDP_"


@dataclass(frozen=True)
class Topology:
    """How many machines and processes a launch config starts, and where they meet.

    One machine: a static rendezvous on this host. Several: torch's c10d rendezvous at node 0
    (``same_network: false`` makes accelerate hand torchrun an ``rdzv_endpoint``; with ``true`` it
    would pass a master address that c10d ignores). Each node launches the same file with its own
    ``--machine_rank``.
    """

    nodes: int = 1
    procs_per_node: int = 2
    main_process_ip: str | None = None
    main_process_port: int = 29500

    def check(self) -> None:
        if self.procs_per_node < 1:
            raise HftkError("--procs_per_node", f"must be at least 1, got {self.procs_per_node}.",
                            "pass the number of processes (GPUs) per machine, e.g. 2.")
        if self.nodes < 1:
            raise HftkError("--nodes", f"must be at least 1, got {self.nodes}.", "pass the number of machines.")
        if self.nodes > 1 and not self.main_process_ip:
            raise HftkError("--main_process_ip", f"a {self.nodes}-node config needs node 0's address.",
                            "pass --main_process_ip HOST (reachable from every node).")

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"num_machines": self.nodes, "num_processes": self.nodes * self.procs_per_node,
                                  "machine_rank": 0, "rdzv_backend": "static", "same_network": True}
        if self.nodes > 1:
            fields.update(rdzv_backend="c10d", same_network=False, main_process_ip=self.main_process_ip,
                          main_process_port=self.main_process_port)
        return fields

    def launch_hint(self, config_file: Path) -> list[str]:
        """Header lines telling how to start each node (what a YAML cannot say)."""
        if self.nodes == 1:
            return [f"# accelerate launch --config_file {config_file} scripts/finetune.py [options]"]
        return [
            f"# On each of the {self.nodes} nodes (R = 0..{self.nodes - 1}), from the repository root:",
            "#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PET_RDZV_ID=<job id> accelerate launch --config_file "
            f"{config_file} --machine_rank R --rdzv_conf join_timeout=300 --max_restarts 1 "
            "scripts/finetune.py --resume_from_checkpoint latest [options]",
        ]


def deepspeed_json_path(out: Path, strategy: str) -> Path:
    return out / "deepspeed" / f"{strategy}.json"


def deepspeed_json(strategy: str) -> dict[str, Any]:
    """The DeepSpeed config of ``strategy`` for hftk's default options (model values stay "auto")."""
    from hftk.config.options import load_config
    from hftk.strategies.deepspeed import deepspeed_config

    return deepspeed_config(load_config(["--strategy", strategy]))


def accelerate_config(strategy: str, topology: Topology, out: Path) -> dict[str, Any]:
    """The accelerate launch config (as a mapping) of one strategy."""
    # use_cpu would make accelerate start ONE process; hftk sets TrainingArguments(use_cpu) itself when there is
    # no GPU.
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False,
        "gpu_ids": "all", "main_training_function": "main", "use_cpu": False, **topology.fields(),
        "distributed_type": STRATEGIES[strategy].launch}
    if strategy in DEEPSPEED_STRATEGIES:
        # No mixed_precision here: accelerate refuses it beside a deepspeed_config_file (the JSON's
        # bf16/fp16 "auto" follow hftk's --bf16/--fp16).
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(deepspeed_json_path(out, strategy)),
            "deepspeed_multinode_launcher": "standard",
            "zero3_init_flag": strategy.startswith("zero3"),
        }
        return config
    config["mixed_precision"] = "no"  # precision is hftk's --bf16 / --fp16 (TrainingArguments)
    config["dynamo_config"] = {"dynamo_backend": "NO"}
    if strategy == "fsdp":
        from hftk.config.options import StrategyConfig

        defaults = StrategyConfig()
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": defaults.fsdp_reshard_after_forward,
            "fsdp_offload_params": defaults.fsdp_cpu_offload,
            "fsdp_state_dict_type": FSDP_STATE_DICT_TYPES[defaults.fsdp_state_dict],
            "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": False}
    return config


def render_yaml(strategy: str, topology: Topology, out: Path) -> str:
    header = [
        "# Generated by `hftk configs` from hftk's typed config; a test keeps it equal to the generator.",
        *topology.launch_hint(out / f"{strategy}.yaml"),
        f"# {STRATEGIES[strategy].usage}",
        "# torchrun underneath: N ranks on GPUs (NCCL) and on CPU-only machines (gloo) alike.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(accelerate_config(strategy, topology, out), sort_keys=True)


def render_all(out: Path = DEFAULT_OUT, topology: Topology = Topology()) -> dict[Path, str]:
    """Every file ``hftk configs`` writes: path -> text."""
    topology.check()
    files = {out / f"{s}.yaml": render_yaml(s, topology, out) for s in LAUNCH_STRATEGIES}
    for strategy in DEEPSPEED_STRATEGIES:
        files[deepspeed_json_path(out, strategy)] = json.dumps(deepspeed_json(strategy), indent=2) + "\n"
    return files


def write_configs(out: Path = DEFAULT_OUT, topology: Topology = Topology()) -> list[Path]:
    files = render_all(out, topology)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


# ---- inside a run: which strategy did the launch config ask for? ----

def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def launcher_strategy(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(strategy, where it came from) according to accelerate's environment, or None."""
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        return _deepspeed_strategy(environ)
    if _flag(environ, "ACCELERATE_USE_FSDP"):
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise HftkError("launch", f"the launch config asks for FSDP version {version}; hftk applies FSDP2.",
                            "set fsdp_version: 2 (or regenerate with `hftk configs`).")
        return "fsdp", "the launch config (distributed_type FSDP)"
    return None


def _deepspeed_strategy(environ: Mapping[str, str]) -> tuple[str, str]:
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        raise HftkError("launch", "the launch config asks for DeepSpeed without a deepspeed_config_file.",
                        "launch with accelerate_configs/zero1|zero2|zero3|zero3_offload.yaml.")
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HftkError("launch", f"cannot read the launch config's DeepSpeed file {path}: {exc}.",
                        "launch from the folder the configs were generated in (paths are relative to it).") from None
    zero = given.get("zero_optimization", {})
    offload = "offload_param" in zero or "offload_optimizer" in zero
    strategy = next((n for n in DEEPSPEED_STRATEGIES if (STRATEGIES[n].zero_stage, STRATEGIES[n].offload)
                     == (zero.get("stage"), offload)), None)
    if strategy is None or given != deepspeed_json(strategy):
        raise HftkError(
            "launch", f"{path} is not one of hftk's DeepSpeed configs; hftk builds DeepSpeed's config from its own "
            "options and would ignore the file's settings.",
            "launch accelerate_configs/<strategy>.yaml as `hftk configs` writes it and set options through hftk "
            "(e.g. --max_grad_norm), or run your own JSON without hftk.",
        )
    return strategy, f"the launch config ({path})"


def _check_fsdp_options(cfg: Any, environ: Mapping[str, str]) -> None:
    """The YAML's FSDP options must agree with hftk's, which are the ones applied."""
    s = cfg.strategy
    pairs = [
        ("FSDP_OFFLOAD_PARAMS", "fsdp_offload_params", str(s.fsdp_cpu_offload).lower(), "--fsdp_cpu_offload"),
        ("FSDP_RESHARD_AFTER_FORWARD", "fsdp_reshard_after_forward", str(s.fsdp_reshard_after_forward).lower(),
         "--fsdp_reshard_after_forward"),
        ("FSDP_STATE_DICT_TYPE", "fsdp_state_dict_type", FSDP_STATE_DICT_TYPES[s.fsdp_state_dict], "--fsdp_state_dict"),
    ]
    for env, yaml_key, ours, option in pairs:
        theirs = environ.get(env)
        if theirs is not None and theirs != ours:
            raise HftkError("launch", f"the launch config sets {yaml_key} {theirs} but hftk's {option} is {ours}; "
                            "hftk applies FSDP2 from its own options.", f"pass {option} to hftk to match, or "
                            "regenerate the launch config with `hftk configs`.")


def adopt_launcher_strategy(cfg: Any, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``cfg.strategy.strategy`` from the launch config; returns where it came from (None: nothing).

    The launch config wins over the default ``ddp``; any other explicit strategy that contradicts it
    is an error, as is ``auto`` (a launch config has already chosen).
    """
    found = launcher_strategy(environ)
    if found is None:
        return None
    launched, source = found
    asked = cfg.strategy.strategy
    if asked not in (launched, DEFAULT_STRATEGY):
        raise HftkError("strategy.strategy", f"is {asked}, but {source} starts {launched}.",
                        f"drop --strategy, or launch accelerate_configs/{asked}.yaml"
                        + (" (or torchrun) to let the plan choose." if asked == "auto" else "."))
    cfg.strategy.strategy = launched
    if int(environ.get("RANK", "0")) == 0:
        print(f"hftk: strategy {launched} from {source}", flush=True)
    if launched == "fsdp":
        _check_fsdp_options(cfg, environ)
        # hftk shards with fully_shard itself; left set, accelerate would apply its own FSDP on GPU.
        for key in [k for k in environ if k == "ACCELERATE_USE_FSDP" or k.startswith(FSDP_ENV_PREFIX)]:
            del environ[key]
    return source


def build_parser() -> argparse.ArgumentParser:
    """``hftk configs``' options (also rendered on the documentation's command reference)."""
    parser = argparse.ArgumentParser(prog="hftk configs", description="Write accelerate launch configs (YAML) and "
                                     "DeepSpeed configs (JSON) for every strategy from hftk's typed config.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=1, help="machines")
    parser.add_argument("--procs_per_node", type=int, default=2, help="processes (GPUs) per machine")
    parser.add_argument("--main_process_ip", default=None, help="node 0's address (needed for --nodes > 1)")
    parser.add_argument("--main_process_port", type=int, default=29500, help="rendezvous port on node 0")
    return parser


def configs_command(argv: list[str]) -> int:
    """``hftk configs``: (re)write the launch configs."""
    args = build_parser().parse_args(argv)
    topology = Topology(args.nodes, args.procs_per_node, args.main_process_ip, args.main_process_port)
    for path in write_configs(args.out, topology):
        print(path)
    return 0
