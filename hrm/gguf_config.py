"""A GGUF file's metadata and tensor list, stated as the config.json fields hrm.hf_config reads.

The keys are those llama.cpp's convert_hf_to_gguf.py writes (its conversion/ modules: base.py's
TextModel.set_gguf_parameters, llama.py, qwen.py, deepseek.py, gpt_oss.py, glm.py). Where a
family's header leaves a field out, the tensors say it (a layer without a router is dense; no
`output.weight` means a tied head; biases and q/k norms by their tensors) or, failing that, the
value is the one llama.cpp itself assumes for the architecture, named in the function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hrm.errors import HrmError

SIGMOID = 2  # expert_gating_func: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


class _Header:
    """One file's metadata under its architecture's prefix, and its tensor names."""

    def __init__(self, arch: str, metadata: Mapping[str, Any], tensors, where: str):
        self.arch, self.metadata, self.tensors, self.where = arch, metadata, tensors, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise HrmError(f"{self.where}: metadata key {self.arch}.{key} is missing")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def layers(self) -> int:
        return int(self.need("block_count")) - int(self.get("nextn_predict_layers", 0) or 0)

    def dense_layers(self) -> list[int]:
        """The layers whose FFN has no router (llama.cpp's ffn_gate_inp)."""
        return [i for i in range(self.layers()) if not self.has(f"blk.{i}.ffn_gate_inp.weight")]


def _rope(h: _Header) -> dict[str, Any]:
    """rope_parameters: the base, and YaRN's fields where the file states a yarn scaling."""
    params: dict[str, Any] = {"rope_theta": float(h.get("rope.freq_base", 10000.0)),
                              "rope_type": "default"}  # fmt: skip
    kind = h.get("rope.scaling.type")
    if kind in (None, "none"):
        return params
    if kind != "yarn":
        raise HrmError(f"{h.where}: rope scaling {kind!r} is not supported; supported: yarn")
    params |= {"rope_type": "yarn", "factor": float(h.need("rope.scaling.factor")),
               "original_max_position_embeddings": int(
                   h.need("rope.scaling.original_context_length"))}  # fmt: skip
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if h.get(f"rope.scaling.{key}") is not None:
            params[field] = float(h.get(f"rope.scaling.{key}"))
    return params


def _common(h: _Header) -> dict[str, Any]:
    heads = int(h.need("attention.head_count"))
    kv_heads = h.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise HrmError(f"{h.where}: key/value heads vary by layer ({kv_heads}); not supported")
        kv_heads = kv_heads[0]
    embed = h.tensors.get("token_embd.weight")
    if embed is None:
        raise HrmError(f"{h.where}: tensor token_embd.weight is missing; the file is incomplete")
    eos = h.metadata.get("tokenizer.ggml.eos_token_id")
    return dict(
        num_hidden_layers=h.layers(),
        hidden_size=int(h.need("embedding_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        num_experts_per_tok=int(h.need("expert_used_count")),
        vocab_size=int(embed.shape[0]),
        tie_word_embeddings=not h.has("output.weight"),
        max_position_embeddings=h.get("context_length"),
        rms_norm_eps=float(h.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope(h),
        eos_token_id=None if eos is None else int(eos),
    )


def _head_dim(h: _Header) -> dict[str, Any]:
    key = h.get("attention.key_length")
    return {} if key is None else {"head_dim": int(key)}


def _mixtral(h: _Header) -> dict[str, Any]:
    """A `llama` file with experts: Mixtral. llama.cpp stores its q and k rows permuted for
    its rotary (executor/gguf_tensors.py undoes it)."""
    return (
        _common(h)
        | _head_dim(h)
        | dict(
            model_type="mixtral",
            intermediate_size=int(h.need("feed_forward_length")),
            num_local_experts=int(h.get("expert_count")),
        )
    )


def _qwen_moe(h: _Header, model_type: str) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE. llama.cpp normalises Qwen3-MoE's top-k weights and not
    Qwen2-MoE's (its norm_w in llama-model.cpp), as the released configs say."""
    expert_width = int(h.need("expert_feed_forward_length"))
    fields = (
        _common(h)
        | _head_dim(h)
        | dict(
            model_type=model_type,
            num_experts=int(h.need("expert_count")),
            moe_intermediate_size=expert_width,
            intermediate_size=int(h.get("feed_forward_length", expert_width)),
            norm_topk_prob=model_type == "qwen3_moe",
            mlp_only_layers=h.dense_layers(),
        )
    )
    bias = h.has("blk.0.attn_q.bias")
    if model_type == "qwen2_moe":
        shared = int(h.get("expert_shared_feed_forward_length", 0) or 0)
        return fields | dict(shared_expert_intermediate_size=shared, qkv_bias=bias)
    return fields | dict(attention_bias=bias)


def _deepseek2(h: _Header) -> dict[str, Any]:
    """DeepSeek-V2 and -V3 (llama.cpp's deepseek2): V3 routes by sigmoid with a choice bias
    (exp_probs_b). GGUF records mscale_all_dim as yarn_log_multiplier / 0.1; mscale is taken
    equal to it, as in every released V2 and V3 config. Older files (before key_length_mla)
    state the MLA head sizes in key_length and value_length."""
    rope = int(h.need("rope.dimension_count"))
    if h.get("attention.key_length_mla") is not None:
        key, value = h.get("attention.key_length_mla"), h.get("attention.value_length_mla")
    else:
        key, value = h.need("attention.key_length"), h.need("attention.value_length")
    v3 = h.get("expert_gating_func") == SIGMOID or h.has(f"blk.{h.layers() - 1}.exp_probs_b.bias")
    groups, used = int(h.get("expert_group_count", 1) or 1), h.get("expert_group_used_count", 1)
    params = _rope(h)
    if params["rope_type"] == "yarn" and h.get("rope.scaling.yarn_log_multiplier"):
        mscale = round(float(h.get("rope.scaling.yarn_log_multiplier")) / 0.1, 6)
        params |= {"mscale": mscale, "mscale_all_dim": mscale}
    fields = _common(h) | dict(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        rope_parameters=params,
        kv_lora_rank=int(h.need("attention.kv_lora_rank")),
        q_lora_rank=h.get("attention.q_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key) - rope,
        v_head_dim=int(value),
        n_routed_experts=int(h.need("expert_count")),
        n_shared_experts=int(h.get("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(h.need("expert_feed_forward_length")),
        intermediate_size=int(h.need("feed_forward_length")),
        first_k_dense_replace=int(h.get("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(h.get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(h.get("expert_weights_norm", False)),
        n_group=groups,
        topk_group=int(used or 1),
    )
    if not v3:
        fields["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return fields


def _gpt_oss(h: _Header) -> dict[str, Any]:
    """gpt-oss. Its header states the window but not which layers slide: llama.cpp slides
    every even layer (its gpt-oss swa pattern), as the released models do; YaRN untruncated, as
    their configs say (truncate false)."""
    layers = h.layers()
    fields = _common(h)
    fields["rope_parameters"] |= {"truncate": False}
    return (
        fields
        | _head_dim(h)
        | dict(
            model_type="gpt_oss",
            num_local_experts=int(h.need("expert_count")),
            intermediate_size=int(h.need("expert_feed_forward_length")),
            sliding_window=int(h.need("attention.sliding_window")),
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],  # fmt: skip
        )
    )


def _glm4_moe(h: _Header) -> dict[str, Any]:
    """GLM-4.5: rotary over rope.dimension_count of each head; the multi-token-prediction
    layers that block_count includes are left out (nextn_predict_layers)."""
    fields = _common(h) | _head_dim(h)
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    rotary = int(h.get("rope.dimension_count", head_dim))
    fields["rope_parameters"] = fields["rope_parameters"] | {
        "partial_rotary_factor": rotary / head_dim
    }
    return fields | dict(
        model_type="glm4_moe",
        n_routed_experts=int(h.need("expert_count")),
        moe_intermediate_size=int(h.need("expert_feed_forward_length")),
        intermediate_size=int(h.need("feed_forward_length")),
        n_shared_experts=int(h.get("expert_shared_count", 0) or 0),
        first_k_dense_replace=int(h.get("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(h.get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(h.get("expert_weights_norm", True)),
        n_group=int(h.get("expert_group_count", 1) or 1),
        topk_group=int(h.get("expert_group_used_count", 1) or 1),
        use_qk_norm=h.has("blk.0.attn_q_norm.weight"),
        attention_bias=h.has("blk.0.attn_q.bias"),
    )


_FAMILIES = {
    "llama": _mixtral,
    "qwen2moe": lambda h: _qwen_moe(h, "qwen2_moe"),
    "qwen3moe": lambda h: _qwen_moe(h, "qwen3_moe"),
    "deepseek2": _deepseek2,
    "gpt-oss": _gpt_oss,
    "glm4moe": _glm4_moe,
}
ARCHITECTURES = tuple(_FAMILIES)


def config_of(architecture: Any, metadata: Mapping[str, Any], tensors, where: str) -> dict:
    """config.json's fields for a GGUF header; refused in one line for what hrm cannot plan."""
    if architecture not in _FAMILIES:
        raise HrmError(
            f"{where}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (llama only with experts: Mixtral)"
        )
    h = _Header(architecture, metadata, tensors, where)
    if not h.get("expert_count"):
        raise HrmError(
            f"{where}: a dense model (architecture {architecture}, no {architecture}.expert_count)"
            "; hrm plans and runs mixtures of experts only"
        )
    try:
        return _FAMILIES[architecture](h)
    except (TypeError, ValueError) as exc:
        raise HrmError(f"{where}: malformed metadata ({exc})") from None
