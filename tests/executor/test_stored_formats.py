"""Checkpoints stored compressed (executor/stored_formats.py): gpt-oss's MXFP4 experts and FP8
block-scaled weights (DeepSeek-V3's layout, Qwen3's and GLM's FP8 releases) decoded at load as
transformers decodes them, and the stored formats that are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from executor.stored_formats import FP4_VALUES, decode_fp8_blocks, decode_mxfp4
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_bad_input import run_expecting_error

LENGTHS = (5, 12, 1, 9)
STEPS = 12


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> blocks uint8 [..., out, in/32, 16] and scales uint8 [..., out, in/32]:
    each block's largest magnitude scaled to at most 6, every value rounded to the nearest E2M1
    magnitude (a test's encoder; released checkpoints come encoded)."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [..., G]
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_decoding_equals_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 40, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        ours = decode_mxfp4(blocks, scales, dtype)  # [E, out, in]
        assert ours.dtype == dtype and torch.equal(ours, theirs.transpose(1, 2))
    # the codes in order, low nibble first: byte 0x21 holds code 1 (0.5) then code 2 (1.0)
    byte = torch.full((1, 16), 0x21, dtype=torch.uint8)
    one = decode_mxfp4(byte, torch.tensor([128], dtype=torch.uint8), torch.float32)  # [32]
    assert one[:4].tolist() == [1.0, 2.0, 1.0, 2.0]  # times 2^(128 - 127)


@pytest.fixture(scope="module")
def mxfp4_pair(checkpoints, tmp_path_factory):
    """(gpt-oss with its experts stored in MXFP4 as released, transformers' model of the values
    its own dequantizer decodes from those blocks)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = checkpoints["gpt_oss"]
    dst = tmp_path_factory.mktemp("mxfp4") / "gpt_oss-mxfp4"
    dst.mkdir()
    tensors, decoded = load_file(src / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2))  # as [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        decoded[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(config))
    reference = reference_model(src)
    with torch.no_grad():
        for name, values in decoded.items():
            reference.get_parameter(name).copy_(values)
    return dst, reference


def test_mxfp4_experts_give_transformers_tokens(mxfp4_pair):
    from tests.executor.test_matches_transformers import reference_generate

    path, reference = mxfp4_pair
    prompts = ragged_prompts(LENGTHS, seed=3)
    ours = generate(MoEModel(open_checkpoint(path, "float32")), prompts, STEPS)
    theirs, _ = reference_generate(reference, prompts, STEPS)
    assert ours.output_token_ids == theirs


def test_an_unsupported_stored_format_is_refused_before_loading(run_cli, tmp_path, checkpoints):
    path = tmp_path / "gptq"
    shutil.copytree(checkpoints["mixtral-single"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    run_expecting_error(
        run_cli, tmp_path, path, fragments=("'gptq'", "supported: 16- and 32-bit floats, mxfp4")
    )


def without(src, tmp_path, name: str):
    """A copy of checkpoint `src` with tensor `name` removed."""
    path = tmp_path / "without"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_blocks_without_their_scales_name_the_tensor(run_cli, tmp_path, mxfp4_pair):
    path = without(mxfp4_pair[0], tmp_path, "model.layers.1.mlp.experts.down_proj_scales")
    run_expecting_error(
        run_cli, tmp_path, path,
        fragments=("model.layers.1.mlp.experts.down_proj_scales is missing", "MXFP4"),
    )  # fmt: skip


FP8_BLOCK = [48, 48]  # 64 and 96 wide weights: whole blocks and a remainder of 16


def encode_fp8_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> float8_e4m3fn weights and float32 scale_inv per block (each block's
    largest magnitude to e4m3's 448), as FP8 checkpoints store them."""
    (out, inp), (bo, bi) = w.shape, block
    rows, cols = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:out, :inp] = w.float()
    amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448.0
    full = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    return (w.float() / full).to(torch.float8_e4m3fn), scale_inv


def test_fp8_block_decoding_equals_transformers_dequantizer():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(100, 70, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(4, 3, generator=g) * 1e-2  # blocks of 32 x 32, the last partial
    for dtype in (torch.float32, torch.bfloat16):
        theirs = _dequantize_fp8_weight(weight.clone(), scale_inv, [32, 32], dtype)
        assert torch.equal(decode_fp8_blocks(weight, scale_inv, (32, 32), dtype), theirs)
    with pytest.raises(ValueError, match="do not tile"):
        decode_fp8_blocks(weight, scale_inv[:3], (32, 32), torch.float32)


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def fp8_pair(checkpoints, tmp_path_factory, request):
    """(GLM-4.5 or DeepSeek-V3 with its linear weights stored in FP8 blocks as FP8 releases
    store them - the embedding, norms, routers and LM head left 16-bit - and the same model with
    those weights decoded by transformers' own dequantizer, saved in 32 bits)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    src = checkpoints[request.param]
    root = tmp_path_factory.mktemp("fp8")
    fp8, twin = root / f"{request.param}-fp8", root / f"{request.param}-decoded"
    for d in (fp8, twin):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    stored, decoded = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        keep = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
        if t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in keep):
            w, scale_inv = encode_fp8_blocks(t, FP8_BLOCK)
            stored[name], stored[name + "_scale_inv"] = w, scale_inv
            decoded[name] = _dequantize_fp8_weight(w.clone(), scale_inv, FP8_BLOCK, torch.float32)
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(decoded, twin / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": FP8_BLOCK}  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, twin


def test_fp8_weights_give_transformers_tokens(fp8_pair):
    from tests.executor.test_matches_transformers import reference_generate

    path, twin = fp8_pair
    prompts = ragged_prompts(LENGTHS, seed=3)
    checkpoint = open_checkpoint(path, "float32")
    assert checkpoint.weights.layers[1].experts[0].w1.dtype == torch.float32
    ours = generate(MoEModel(checkpoint), prompts, STEPS)
    theirs, _ = reference_generate(reference_model(twin), prompts, STEPS)
    assert ours.output_token_ids == theirs


@pytest.mark.parametrize(
    ("quantization", "fragment"),
    [
        ({"quant_method": "fp8", "fmt": "e4m3"}, "fp8 without e4m3 blocks"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e4m3"),
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ],
)
def test_other_fp8_layouts_are_refused_before_loading(run_cli, tmp_path, fp8_pair, quantization,
                                                      fragment):  # fmt: skip
    path = tmp_path / "other"
    shutil.copytree(fp8_pair[0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    run_expecting_error(run_cli, tmp_path, path, fragments=(fragment,))


def test_an_fp8_weight_without_its_scales_names_them(run_cli, tmp_path, fp8_pair):
    path = without(fp8_pair[0], tmp_path, "model.layers.1.self_attn.o_proj.weight_scale_inv")
    missing = "model.layers.1.self_attn.o_proj.weight_scale_inv is missing"
    run_expecting_error(run_cli, tmp_path, path, fragments=(missing,))
