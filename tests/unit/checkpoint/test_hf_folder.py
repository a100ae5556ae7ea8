"""The HF folder layer (hftk.checkpoint.hf_folder): a DCP model folder is read whole in one process."""

from __future__ import annotations

import torch


def test_a_dcp_model_folder_is_read_whole_in_one_process(tmp_path):
    """``hftk export``'s reader of fsdp and mesh checkpoints: the model entries only, named as the model names them."""
    import torch.distributed.checkpoint as dcp

    from hftk.checkpoint.hf_folder import read_dcp_model

    model = {"model.layers.0.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(5, 3)}  # llama-like names
    dcp.save({"model": model, "optim": {"step": torch.tensor(3.0)}}, checkpoint_id=tmp_path, no_dist=True)
    got = read_dcp_model(tmp_path)
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], v) for k, v in model.items())
