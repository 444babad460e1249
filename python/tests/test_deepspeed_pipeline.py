"""diffusion-pipe's shape: a DeepSpeed PipelineModule of block-wrapping layers, trained by
DeepSpeed's PipelineEngine on 2 CPU ranks (Gloo), each stage's blocks swapped by its own
ModelOffloader, bitwise equal to the same without blockswap (deepspeed_pipeline_worker.py says
what differs from diffusion-pipe's train.py, which forbids block swapping with
pipeline_stages > 1)."""
import os

import pytest

from test_pipeline import run_ranks

pytest.importorskip("deepspeed")

WORKER = os.path.join(os.path.dirname(__file__), "deepspeed_pipeline_worker.py")


def test_deepspeed_pipeline_stages_swap_exactly(tmp_path):
    results = run_ranks(WORKER, tmp_path / "deepspeed", [])
    # 4 blocks a stage, K = 2, 4 micro-batches a step (DeepSpeed's 1F1B): the plan's 2K loads
    # per micro-batch on the last stage; the first stage's one warm-up forward reloads 2K more.
    assert [r["loads"][-1] for r in results] == [2 * 2 * 4 + 2 * 2, 2 * 2 * 4], results
