import pytest


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """A small model of every family in ``FAMILIES`` (tests/unit/data/test_dataset.py), from its default config
    (``tests.helpers.make_family``), made once for the packing exactness tests of the data,
    pipeline and mesh modules; read only."""
    from tests.helpers import make_family
    from tests.unit.data.test_dataset import FAMILIES

    root = tmp_path_factory.mktemp("families")
    return {f: make_family(f, root / f) for f in FAMILIES}
