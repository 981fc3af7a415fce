"""Tiny random checkpoints of every family the executor runs, saved by transformers, and their
reference models.

transformers 5.x `save_pretrained` writes Mixtral in the original per-expert layout; the fused
layout (mlp.experts.gate_up_proj / down_proj) that 5.x can also save is produced here by rewriting
the safetensors file, and transformers itself loads it back as a check of the rewrite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

VOCAB = 256
LAYERS = 3  # odd: the two weight slots then hold different layers from step to step
HIDDEN = 64
EXPERT_WIDTH = 96
EXPERTS = 4


# what every Llama-style tiny config shares
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # peaked logits: greedy choices are not near-ties
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    eos_token_id=None,
    bos_token_id=None,
)


def _mixtral_config(**overrides):
    from transformers import MixtralConfig

    fields = _TINY | dict(intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS)
    return MixtralConfig(**(fields | overrides))


def _dbrx_config():
    from transformers import DbrxConfig

    return DbrxConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        n_heads=4,
        n_layers=LAYERS,
        max_seq_len=512,
        initializer_range=0.1,
        attn_config={"kv_n_heads": 2, "clip_qkv": 1.0, "rope_theta": 500000},
        ffn_config={"ffn_hidden_size": EXPERT_WIDTH, "moe_num_experts": EXPERTS, "moe_top_k": 2},
    )


def _qwen_family_config(model_type: str, **overrides):
    """Qwen2-MoE, Qwen3-MoE or OLMoE at the tiny shape: Qwen3-MoE with a head_dim of its own
    (32, not hidden / heads = 16) and top-k renormalised; Qwen2-MoE with its gated shared expert
    and q/k/v biases, top-k not renormalised; OLMoE with q/k norms over the whole projection."""
    from transformers import AutoConfig

    fields = _TINY | dict(num_experts=EXPERTS, pad_token_id=None)
    fields |= {
        "qwen3_moe": dict(
            moe_intermediate_size=EXPERT_WIDTH, intermediate_size=128, head_dim=32,
            norm_topk_prob=True,
        ),
        "qwen2_moe": dict(
            moe_intermediate_size=EXPERT_WIDTH, intermediate_size=128,
            shared_expert_intermediate_size=80, norm_topk_prob=False,
        ),
        "olmoe": dict(intermediate_size=EXPERT_WIDTH, norm_topk_prob=False),
    }[model_type]  # fmt: skip
    return AutoConfig.for_model(model_type, **(fields | overrides))


# gpt-oss at the tiny shape: layers 0 and 2 slide over 6 keys (the prompts are up to 12 long and
# 16 tokens follow), YaRN as the released models have it, a head_dim of its own
GPT_OSS_WINDOW = 6


def _gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    fields = _TINY | dict(
        intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS, head_dim=24, pad_token_id=None,
        max_position_embeddings=131072,
        sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False},
    )  # fmt: skip
    return GptOssConfig(**(fields | overrides))


def save_gpt_oss(path: Path, seed: int, **overrides) -> Path:
    """A random gpt-oss whose every term counts: biases, sinks and norms drawn, and the experts'
    pre-activations past the GLU's clamp of 7."""
    draws = ((("bias", "sinks"), 0.5), (("gate_up_proj",), 0.6), (("down_proj",), 0.05))
    return save_with_random_extras(_gpt_oss_config(**overrides), path, seed, draws)


def _glm4_moe_config(**overrides):
    """GLM-4.5 at the tiny shape: 8 experts in 2 groups, one group kept, top-3, scaled by 2.5;
    rotary over half of each head of 32; q/k norms; layer 0 dense; a shared expert."""
    from transformers import Glm4MoeConfig

    fields = _TINY | dict(
        moe_intermediate_size=EXPERT_WIDTH, intermediate_size=128, head_dim=32,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3,
        routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, pad_token_id=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip
    return Glm4MoeConfig(**(fields | overrides))


# DeepSeek at the tiny shape: latent attention (a latent of 32, rotary keys of 8, key heads of
# 16 + 8, values of 24), YaRN with its mscale, layer 0 dense, shared experts, 8 experts in groups
_DEEPSEEK = dict(
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, n_routed_experts=8,
    moe_intermediate_size=EXPERT_WIDTH, intermediate_size=128, first_k_dense_replace=1,
    num_experts_per_tok=3, pad_token_id=None, max_position_embeddings=163840,
    num_key_value_heads=4,  # as the released configs: transformers repeats K/V by nq / this
)  # fmt: skip


def _deepseek_config(model_type: str, **overrides):
    """DeepSeek-V2: q projected directly, softmax routing limited to the best 2 of 4 groups,
    scaled by 2, values of 24; YaRN with mscale 0.707 in both places (the released V2-Lite's).
    DeepSeek-V3: q through a rank of 24, sigmoid routing in 2 groups, one kept, renormalised and
    scaled by 2.5, values of 16; YaRN with mscale_all_dim 1 (the released V3's), which scales
    the softmax."""
    from transformers import AutoConfig

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    fields = _TINY | _DEEPSEEK | {
        "deepseek_v2": dict(
            q_lora_rank=None, v_head_dim=24, n_shared_experts=2, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=2.0,
            rope_parameters=yarn | {"mscale": 0.707, "mscale_all_dim": 0.707},
        ),
        "deepseek_v3": dict(
            q_lora_rank=24, v_head_dim=16, n_shared_experts=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters=yarn | {"mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    }[model_type]  # fmt: skip
    return AutoConfig.for_model(model_type, **(fields | overrides))


def save_with_random_extras(config, path: Path, seed: int, draws=((("bias",), 0.2),)) -> Path:
    """save_model, with what transformers initialises to constants drawn instead, so that every
    term of the family counts: norms 1 + N(0, 0.1^2), and each tensor whose name ends in one of
    a draw's suffixes N(0, std^2) (default: biases, a router's choice-only bias among them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
                continue
            std = next((std for ends, std in draws if name.endswith(ends)), None)
            if std is not None:
                t.copy_(std * torch.randn(t.shape, generator=g))
    model.save_pretrained(path)
    return path


def fuse_experts(src: Path, dst: Path, old: str = "mlp.experts.", new: str = "mlp.experts.",
                 names=("gate_proj", "up_proj", "down_proj")) -> Path:  # fmt: skip
    """Rewrite a checkpoint's per-expert tensors ({old}{e}.{gate, up, down}.weight under each
    layer) into the fused 5.x layout ({new}gate_up_proj [E, 2I, H], {new}down_proj [E, H, I])."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    fused = {name: t for name, t in tensors.items() if f".{old}" not in name}
    gate, up, down = names
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        if f"{prefix}{old}0.{gate}.weight" not in tensors:
            continue  # a dense layer: its MLP is not an expert
        expert = [
            {w: tensors[f"{prefix}{old}{e}.{w}.weight"] for w in names} for e in range(EXPERTS)
        ]
        fused[prefix + new + "gate_up_proj"] = torch.stack(
            [torch.cat([x[gate], x[up]]) for x in expert]
        )
        fused[prefix + new + "down_proj"] = torch.stack([x[down] for x in expert])
    save_file(fused, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def save_model(config, path: Path, seed: int, **save_kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, **save_kwargs)
    return path


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer: "w5 w7" <-> [5, 7]; enough to exercise text prompts offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)


def fuse_mixtral_experts(src: Path, dst: Path) -> Path:
    """Rewrite a per-expert Mixtral checkpoint into the fused 5.x layout, its router renamed to
    mlp.gate as transformers 5.x names it."""
    fuse_experts(src, dst, old="block_sparse_moe.experts.", new="mlp.experts.",
                 names=("w1", "w3", "w2"))  # fmt: skip
    tensors = load_file(dst / "model.safetensors")
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors[p + "mlp.gate.weight"] = tensors.pop(p + "block_sparse_moe.gate.weight")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory; the three Mixtral ones hold the same weights."""
    root = tmp_path_factory.mktemp("checkpoints")
    single = save_model(_mixtral_config(), root / "mixtral-single", seed=0)
    sharded = save_model(
        _mixtral_config(), root / "mixtral-sharded", seed=0, max_shard_size="100KB"
    )
    fused = fuse_mixtral_experts(single, root / "mixtral-fused")
    dbrx = save_model(_dbrx_config(), root / "dbrx", seed=1)
    families = {
        name: save_model(_qwen_family_config(name), root / name, seed=seed)
        for seed, name in enumerate(("qwen2_moe", "qwen3_moe", "olmoe"), start=3)
    }
    # 64 experts, top-8: Qwen3-MoE's regime (128 of them, top-8), not Mixtral's 8 and 2
    wide = save_model(
        _qwen_family_config("qwen3_moe", num_experts=64, num_experts_per_tok=8,
                            moe_intermediate_size=32),
        root / "qwen3_moe-64x8", seed=6,
    )  # fmt: skip
    # dense layers among sparse ones: Qwen2-MoE's layer 1 by mlp_only_layers, Qwen3-MoE's
    # layers 0 and 2 by decoder_sparse_step 2 (transformers: sparse where (i + 1) % step == 0)
    dense = {
        "qwen2_moe-dense": save_model(
            _qwen_family_config("qwen2_moe", mlp_only_layers=[1]), root / "qwen2_moe-dense", 7
        ),
        "qwen3_moe-dense": save_model(
            _qwen_family_config("qwen3_moe", decoder_sparse_step=2), root / "qwen3_moe-dense", 8
        ),
    }
    dense["qwen3_moe-dense-fused"] = fuse_experts(
        dense["qwen3_moe-dense"], root / "qwen3_moe-dense-fused"
    )
    gpt_oss = save_gpt_oss(root / "gpt_oss", seed=11)
    return {
        "gpt_oss": gpt_oss,
        "glm4_moe": save_with_random_extras(_glm4_moe_config(), root / "glm4_moe", seed=12),
        **{
            name: save_with_random_extras(_deepseek_config(name), root / name, seed=seed)
            for seed, name in enumerate(("deepseek_v2", "deepseek_v3"), start=13)
        },
        **dense,
        "mixtral-single": single,
        "mixtral-sharded": sharded,
        "mixtral-fused": fused,
        "dbrx": dbrx,
        **families,
        "qwen3_moe-fused": fuse_experts(families["qwen3_moe"], root / "qwen3_moe-fused"),
        "qwen3_moe-64x8": wide,
    }


@pytest.fixture(scope="session")
def mixtral_with_tokenizer(tmp_path_factory) -> Path:
    path = save_model(
        _mixtral_config(eos_token_id=3),
        tmp_path_factory.mktemp("tok") / "mixtral-tok",
        seed=2,
    )
    save_tokenizer(path)
    return path


def reference_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model for a checkpoint, with DBRX's rope_theta put where 5.x reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if config.model_type == "gpt_oss":  # its reference attention: sinks, in the model's dtype
        config._attn_implementation = "eager"
    if config.model_type == "dbrx":
        # transformers 5.x reads rope_parameters and ignores attn_config.rope_theta.
        theta = json.loads((path / "config.json").read_text())["attn_config"]["rope_theta"]
        config.rope_parameters = {"rope_theta": float(theta), "rope_type": "default"}
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).eval()


def ragged_prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PLAN_LENGTHS = (5, 9, 3, 7, 6, 2, 8, 4, 9, 1)  # ten prompts, batches of three


@pytest.fixture
def this_host(monkeypatch):
    """Plans for an L4 run here are predicted with this host's stand-in model: whichever CI
    machine runs the tests, a bundled CPU profile plays this host's."""
    from hrm.hardware import resolve_hardware
    from hrm.profiling import host_gemm

    monkeypatch.setattr(
        host_gemm, "bundled_profile_of_this_host", lambda: resolve_hardware("ci-cpu-avx512")
    )


@pytest.fixture
def files(checkpoints, tmp_path):
    """A prompts file and a paging plan (CPU attention, nothing resident, N=3, mu=2)."""
    from executor.checkpoint import read_arch
    from hrm.hardware import resolve_hardware
    from hrm.policy import Policy
    from hrm.workload import Workload
    from planner import predict

    path = checkpoints["mixtral-single"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in ragged_prompts(PLAN_LENGTHS, 8))
    )
    policy = Policy(
        batch_size=3,
        micro_batch_size=2,
        attention_on_gpu=False,
        ffn_on_gpu=True,
        weights_gpu_fraction=0.0,
        kv_gpu_fraction=0.0,
        weight_dtype="float32",
        kv_dtype="float32",
    )
    workload = Workload(prompt_len_mean=5.4, prompt_len_max=9, gen_len=4)
    plan = predict(read_arch(path), resolve_hardware("l4"), workload, policy, "cgopipe")
    plan_path = plan.save(tmp_path / "plan.json")
    return path, prompts, plan_path
