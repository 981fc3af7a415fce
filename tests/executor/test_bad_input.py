"""Each user error of `hrm run`: one line naming the file or field, exit 2, no output file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_one_line_error


@pytest.fixture
def broken(checkpoints, tmp_path):
    """A private copy of a checkpoint to damage."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(checkpoints[name], dst)
        return dst

    return copy


def run_expecting_error(run_cli, tmp_path, checkpoint, *extra, fragments=()):
    out = tmp_path / "out.jsonl"
    args = ["run", "--checkpoint", checkpoint, "--gen-len", "2", "--output", out, "--quiet"]
    if "--prompts" not in extra:
        args += ["--prompt-len", "3", "--batch", "2"]
    status, _, err = run_cli(*args, *extra)
    assert_one_line_error(status, err, *fragments)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.jsonl*")), "a temporary output file was left behind"


def test_missing_directory(run_cli, tmp_path):
    missing = tmp_path / "nowhere"
    run_expecting_error(run_cli, tmp_path, missing, fragments=(str(missing),))


def test_missing_config(run_cli, tmp_path, broken):
    path = broken("mixtral-single")
    (path / "config.json").unlink()
    run_expecting_error(run_cli, tmp_path, path, fragments=("config.json",))


@pytest.mark.parametrize("model_type", ["gpt2", "jamba", "phimoe"])
def test_unsupported_model_type(run_cli, tmp_path, broken, model_type):
    """Named, with the families that do run, before any weight is read."""
    path = broken("mixtral-single")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(config))
    run_expecting_error(
        run_cli, tmp_path, path, fragments=("config.json", model_type, "qwen3_moe, olmoe")
    )


@pytest.mark.parametrize(
    ("name", "field"), [("qwen3_moe", "moe_intermediate_size"), ("deepseek_v2", "kv_lora_rank")]
)
def test_a_family_field_missing_is_named(run_cli, tmp_path, broken, name, field):
    path = broken(name)
    config = json.loads((path / "config.json").read_text())
    del config[field]
    (path / "config.json").write_text(json.dumps(config))
    run_expecting_error(run_cli, tmp_path, path, fragments=(f"'{field}'",))


@pytest.mark.parametrize(
    ("name", "change", "fragment"),
    [
        (
            "qwen3_moe",
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "is missing from the checkpoint",
        ),
        ("qwen3_moe", "model.layers.0.self_attn.q_norm.weight", "has shape [5]"),
        # a dense layer (decoder_sparse_step 2 makes layer 0 one) reads its MLP, not experts
        (
            "qwen3_moe-dense",
            "model.layers.0.mlp.down_proj.weight",
            "is missing from the checkpoint",
        ),
        ("qwen3_moe-dense", "model.layers.2.mlp.gate_proj.weight", "has shape [5]"),
    ],
)
def test_a_qwen_tensor_missing_or_misshapen_is_named(run_cli, tmp_path, broken, name, change,
                                                     fragment):  # fmt: skip
    path = broken(name)
    tensors = load_file(path / "model.safetensors")
    if "missing" in fragment:
        del tensors[change]
    else:
        tensors[change] = torch.ones(5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    run_expecting_error(run_cli, tmp_path, path, fragments=(change, fragment))


def test_shard_named_in_index_but_absent(run_cli, tmp_path, broken):
    path = broken("mixtral-sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    run_expecting_error(run_cli, tmp_path, path, fragments=(shard, "missing"))


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_truncated_safetensors(run_cli, tmp_path, broken, keep_fraction):
    path = broken("mixtral-single")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep_fraction)])
    run_expecting_error(run_cli, tmp_path, path, fragments=(str(weights), "truncated"))


def test_corrupt_safetensors_header(run_cli, tmp_path, broken):
    path = broken("dbrx")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json at!"
    weights.write_bytes(bytes(data))
    run_expecting_error(run_cli, tmp_path, path, fragments=(str(weights), "corrupt"))


def test_shape_disagrees_with_config(run_cli, tmp_path, broken):
    path = broken("mixtral-single")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(config))
    run_expecting_error(run_cli, tmp_path, path, fragments=("model.safetensors", "shape"))


def test_missing_tensor(run_cli, tmp_path, broken):
    path = broken("mixtral-single")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    run_expecting_error(
        run_cli, tmp_path, path, fragments=("model.layers.1.self_attn.k_proj.weight",)
    )


def test_prompt_id_outside_vocabulary(run_cli, tmp_path, checkpoints):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3, 256]}\n')
    run_expecting_error(
        run_cli,
        tmp_path,
        checkpoints["mixtral-single"],
        "--prompts",
        prompts,
        fragments=(f"{prompts}:2: token id 256",),
    )


def test_text_prompt_without_tokenizer(run_cli, tmp_path, checkpoints):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    run_expecting_error(
        run_cli,
        tmp_path,
        checkpoints["dbrx"],
        "--prompts",
        prompts,
        fragments=(str(prompts), "tokenizer"),
    )


@pytest.mark.parametrize(
    "line", ['{"prompt_token_ids": []}', '{"prompt_ids": [1]}', "[1, 2]", "{not json"]
)
def test_malformed_prompt_line(run_cli, tmp_path, checkpoints, line):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1]}\n' + line + "\n")
    run_expecting_error(
        run_cli,
        tmp_path,
        checkpoints["dbrx"],
        "--prompts",
        prompts,
        fragments=(f"{prompts}:2",),
    )


@pytest.mark.parametrize(
    "extra",
    [("--gen-len", "0"), ("--dtype", "float8"), ("--device", "tpu"), ("--top-p", "0")],
)
def test_bad_arguments(run_cli, tmp_path, checkpoints, extra):
    run_expecting_error(run_cli, tmp_path, checkpoints["dbrx"], *extra)


def test_cuda_without_a_gpu(run_cli, tmp_path, checkpoints):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run_expecting_error(
        run_cli, tmp_path, checkpoints["dbrx"], "--device", "cuda", fragments=("cuda",)
    )


@pytest.mark.parametrize(
    "profile, fragment",
    [("no-such-machine", "no-such-machine"), ("broken.yaml", "broken.yaml")],
)
def test_bad_hardware_profile(run_cli, tmp_path, checkpoints, profile, fragment):
    (tmp_path / "broken.yaml").write_text("name: x\nsource: measured\ncpu: {cores: 2}\n")
    if profile.endswith(".yaml"):
        profile = str(tmp_path / profile)
    run_expecting_error(
        run_cli, tmp_path, checkpoints["dbrx"], "--hardware", profile, fragments=(fragment,)
    )


def test_gpu_run_needs_a_profile_with_a_gpu(run_cli, tmp_path, checkpoints):
    run_expecting_error(
        run_cli,
        tmp_path,
        checkpoints["dbrx"],
        "--hardware",
        "ci-cpu",
        "--device",
        "cuda",
        fragments=("has no GPU",),
    )
