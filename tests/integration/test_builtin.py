"""The built-in model cache: written before any process group, never published incomplete.

Once a process group is up, transformers' ``save_pretrained`` writes on rank 0 only; a rank it
skipped once won the rename race and cached a folder without weights (a clean-clone CI run).
"""

from __future__ import annotations

import textwrap

from hftk.data.builtin import WEIGHTS
from tests.helpers import torchrun
from tests.unit.data.test_builtin import NAME


def test_a_rank_transformers_skips_never_publishes_a_folder(builtin_cache, tmp_path):
    """Rank 1 materialises inside a process group while rank 0 waits: it must fail by name, not cache
    a folder without weights; rank 0, in its turn, writes the complete one."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import sys
        import torch.distributed as dist
        from hftk.data.builtin import WEIGHTS, materialize_model
        from hftk.core.errors import HftkError

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 1:
            try:
                materialize_model("{NAME}")
                print("RANK1 wrote", flush=True)
            except HftkError as exc:
                print("RANK1 refused:", exc, flush=True)
        dist.barrier()
        if rank == 0:
            print("RANK0 complete:", (materialize_model("{NAME}") / WEIGHTS).is_file(), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    """))
    result = torchrun(2, worker, [], timeout=180, env={"HFTK_CACHE": str(builtin_cache)})
    assert result.returncode == 0, result.output[-4000:]
    assert f"RANK1 refused: model.model_name_or_path: the folder of {NAME} lacks config.json, {WEIGHTS}" \
        in result.output, result.output[-4000:]
    assert "RANK0 complete: True" in result.output
