"""scripts/setup.sh on a GPU machine whose torch cannot see the GPU: one line, non-zero exit,
before anything is installed. nvidia-smi is a script listing one GPU; CUDA_VISIBLE_DEVICES=""
hides any real one, so a CUDA build on a GPU host is refused just as a CPU wheel is."""

from __future__ import annotations

import os

from tests.helpers import ROOT, run


def test_setup_refuses_a_torch_that_does_not_see_the_listed_gpu(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    result = run(["bash", str(ROOT / "scripts" / "setup.sh")], timeout=300,
                 env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in result.stderr.splitlines() if line.startswith("setup:")]
    assert result.returncode != 0, result.output[-3000:]
    assert len(lines) == 1 and "lists 1 GPU(s)" in lines[0] and "sees none" in lines[0], result.output[-3000:]
