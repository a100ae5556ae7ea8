"""A Hub push with no way to upload (offline, or no token) is refused before training."""

from __future__ import annotations

import pytest

from tests.faults import TOKEN
from tests.helpers import TINY_ARGS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("offline, token, problem", [
    (True, TOKEN, "HF_HUB_OFFLINE is set"),
    (False, None, "no Hugging Face token is configured"),
], ids=["offline", "no_token"])
def test_push_without_a_way_to_upload_is_refused_before_training(tmp_path, monkeypatch, offline, token, problem):
    import huggingface_hub.constants

    from hftk.config.options import load_config
    from hftk.core.errors import HftkError
    from hftk.run.validate import check_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-login"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    cfg = load_config([*TINY_ARGS, "--output_dir", str(tmp_path / "out"), "--push_to_hub", "--hub_model_id", "me/x"])
    with pytest.raises(HftkError) as error:
        check_config(cfg)
    assert error.value.field == "training.push_to_hub" and problem in error.value.problem
    assert token is None or token not in str(error.value)
