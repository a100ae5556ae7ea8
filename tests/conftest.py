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


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault tests' kill steps and their seed, also under -q (which hides the header)."""
    import sys

    for line in sys.modules["tests.warm"].summary() if "tests.warm" in sys.modules else []:
        terminalreporter.write_line(line)
    faults = sys.modules.get("tests.faults")
    if faults is not None and faults.DRAWN:
        terminalreporter.write_line(f"hftk fault seed {faults.FAULT_SEED}: {', '.join(faults.DRAWN)} "
                                    f"(HFTK_FAULT_SEED={faults.FAULT_SEED} replays them)")


@pytest.fixture(scope="session", autouse=True)
def _warm_server(request):
    """The warm-rank servers for the suite's own environment (tests/warm.py), started before the first test
    when any multi-process test was collected, so their imports overlap the first tests; stopped with the
    session."""
    from tests import warm

    if any("/integration/" in item.nodeid or item.nodeid.startswith("integration/") for item in request.session.items):
        warm.server_for(warm.cell_env())
        warm.server_for(warm.cell_env(), plain=True)  # the references' (tests.helpers.plain_reference)
    yield
    warm.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _builtin_models() -> None:
    """Materialise the tiny built-in models once, before ranks race for them."""
    from hftk.data.builtin import materialize_model

    for name in ("builtin:gpt2-tiny",):
        materialize_model(name)


@pytest.fixture(scope="module")
def tiny_shape():
    """The plan's view of builtin:gpt2-tiny (meta-device shape and activation traces), shared by the
    plan's unit and integration tests."""
    from hftk.data.builtin import builtin_model_config
    from hftk.plan.estimate import model_shape

    return model_shape(builtin_model_config("builtin:gpt2-tiny"))


@pytest.fixture()
def builtin_cache(tmp_path, monkeypatch):
    """An empty built-in model cache of the test's own (``HFTK_CACHE``)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HFTK_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def hub():
    """A local stand-in Hub (tests/hub_server.py) for every module's pushing runs, each to repositories of its
    own: one endpoint, so their warm ranks share one server (tests/warm.py starts one per environment)."""
    from tests.faults import TOKEN
    from tests.hub_server import HubServer

    with HubServer(token=TOKEN) as server:
        yield server
