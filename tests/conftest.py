import os

import pytest

# Tests never reach a network: no Hub, no wandb cloud, no telemetry.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS)

if not torch.cuda.is_available():  # on a GPU host DeepSpeed picks CUDA itself, as in a user's run
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_report_header() -> str:
    from tests.faults import FAULT_SEED

    return f"hftk fault seed: {FAULT_SEED} (HFTK_FAULT_SEED={FAULT_SEED} replays the random kill steps)"


@pytest.fixture(scope="session", autouse=True)
def _builtin_models() -> None:
    """Materialise the tiny built-in models once, before ranks race for them."""
    from hftk.builtin import materialize_model

    for name in ("builtin:gpt2-tiny",):
        materialize_model(name)
