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


def pytest_configure(config) -> None:
    """One fault seed for the whole session: drawn here, before pytest-xdist starts its workers (they inherit
    the environment), so every worker draws its kill steps from the seed the summary prints."""
    import random

    if not hasattr(config, "workerinput"):
        os.environ.setdefault("HFTK_FAULT_SEED", str(random.SystemRandom().randrange(2**32)))
    config.hftk_summary = []


def _summary() -> list[str]:
    """This process's warm servers and drawn fault steps."""
    import sys

    lines = list(sys.modules["tests.warm"].summary() if "tests.warm" in sys.modules else [])
    faults = sys.modules.get("tests.faults")
    return lines + [f"fault drawn: {drawn}" for drawn in (faults.DRAWN if faults is not None else [])]


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its lines go to the controller
        session.config.workeroutput["hftk_summary"] = _summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: keep each worker's lines for the summary."""
    node.config.hftk_summary.extend(node.workeroutput.get("hftk_summary", []) if hasattr(node, "workeroutput") else [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The warm servers' cell counts and the fault tests' kill steps with their seed, also under -q (which hides
    the header), from this process or from every pytest-xdist worker."""
    lines = [*config.hftk_summary, *_summary()]
    for line in (line for line in lines if not line.startswith("fault drawn: ")):
        terminalreporter.write_line(line)
    drawn = [line.removeprefix("fault drawn: ") for line in lines if line.startswith("fault drawn: ")]
    if drawn:
        seed = os.environ["HFTK_FAULT_SEED"]
        terminalreporter.write_line(f"hftk fault seed {seed}: {', '.join(drawn)} (HFTK_FAULT_SEED={seed} replays them)")


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
