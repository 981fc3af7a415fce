"""The executor on a CUDA device: the same tokens as transformers, and `hrm run --device cuda`
with a GPU-resident prediction. Skipped without CUDA (CI); bench/gpu_check.sh runs it."""

from __future__ import annotations

import json

import pytest
import torch

from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_matches_transformers import reference_generate, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", ["mixtral-fused", "dbrx"])
def test_cuda_float32_greedy_tokens_and_logits_match(checkpoints, name):
    path = checkpoints[name]
    prompts = ragged_prompts((5, 12, 1, 9), seed=3)
    theirs, their_logits = reference_generate(reference_model(path), prompts, 16)
    ours = generate(
        MoEModel(open_checkpoint(path, "float32", device="cuda")), prompts, 16, keep_logits=True
    )
    assert ours.output_token_ids == theirs
    for mine, ref in zip(ours.step_logits, their_logits, strict=True):
        # TF32 is off by default for matmuls in torch; 1e-4 as on the CPU
        assert relative_error(mine.float().cpu(), ref) < 1e-4


def test_hrm_run_on_cuda_carries_a_gpu_resident_prediction(run_cli, checkpoints):
    status, stdout, err = run_cli(
        "run", "--checkpoint", checkpoints["dbrx"], "--prompt-len", "8", "--batch", "4",
        "--gen-len", "4", "--device", "cuda", "--hardware", "h200-sxm", "--json", "--quiet",
    )  # fmt: skip
    assert status == 0, err
    record = json.loads(stdout)
    assert record["environment"]["device"].startswith("cuda")
    assert record["predicted"]["generated_tokens"] == 16
    assert record["prediction_error"] is not None


def test_cuda_runs_a_quantized_gguf_as_the_cpu_does(checkpoints, tmp_path):
    """A Q8_0 GGUF (dequantized on the host at load, then moved) gives the CPU's tokens."""
    from tests.gguf_files import write_gguf

    path = write_gguf(checkpoints["qwen3_moe"], tmp_path / "q8.gguf", kind="Q8_0")
    prompts = ragged_prompts((5, 9), seed=4)
    runs = [generate(MoEModel(open_checkpoint(path, "float32", device=d)), prompts, 8)
            for d in ("cpu", "cuda")]  # fmt: skip
    assert runs[0].output_token_ids == runs[1].output_token_ids
