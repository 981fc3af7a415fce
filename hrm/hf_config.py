"""The config.json field names of each supported family, read into ModelArch's fields.

The one place that knows them (docs/architecture.md): each parser returns the keyword arguments
of hrm.arch.ModelArch for one model_type. Supported: mixtral, dbrx, qwen2_moe, qwen3_moe, olmoe,
gpt_oss, glm4_moe, deepseek_v2, deepseek_v3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hrm.errors import HrmError
from hrm.schema import positive_int

MODEL_TYPES = ("mixtral", "dbrx", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe",
               "deepseek_v2", "deepseek_v3")  # fmt: skip
LAYER_TYPES = ("full_attention", "sliding_attention")
# the rope_scaling fields YaRN reads (transformers' _compute_yarn_parameters), with its defaults
YARN_FIELDS = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
               "beta_slow": 1.0, "truncate": True, "attention_factor": None, "mscale": None,
               "mscale_all_dim": None}  # fmt: skip


def _llama_like(c: Mapping[str, Any], width: str, experts: int) -> dict[str, Any]:
    """What Mixtral, Qwen and OLMoE configs name alike: layers, hidden size, heads (a head_dim of
    their own where given), top-k, vocabulary, positions; the expert width under `width`."""
    heads = c["num_attention_heads"]
    return dict(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        intermediate_size=c[width],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        num_experts=experts,
        experts_per_token=c["num_experts_per_tok"],
        vocab_size=c["vocab_size"],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=c.get("max_position_embeddings"),
    )


def _mixtral(c: Mapping[str, Any]) -> dict[str, Any]:
    return _llama_like(c, "intermediate_size", c["num_local_experts"]) | dict(
        norm="rmsnorm",
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=float(_rope_theta(c, 1e6)),
    )


def _dbrx(c: Mapping[str, Any]) -> dict[str, Any]:
    attn, ffn = c["attn_config"], c["ffn_config"]
    heads = c["n_heads"]
    return dict(
        num_layers=c["n_layers"],
        hidden_size=c["d_model"],
        intermediate_size=ffn["ffn_hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=attn["kv_n_heads"],
        head_dim=c["d_model"] // heads,
        num_experts=ffn["moe_num_experts"],
        experts_per_token=ffn["moe_top_k"],
        vocab_size=c["vocab_size"],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm="layernorm",
        norm_eps=1e-5,
        rope_theta=float(attn.get("rope_theta", 10000.0)),
        clip_qkv=attn.get("clip_qkv"),
        router_norm_p=ffn.get("moe_normalize_expert_weights", 1.0),
        renormalize_top_k=False,
        max_position_embeddings=c.get("max_seq_len"),
    )


def _qwen2_moe(c: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: biases on q, k and v, a sigmoid-gated shared expert, top-k weights
    renormalised only where norm_topk_prob says so."""
    fields = _qwen_moe(c)
    fields.update(
        shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0),
        attention_bias=bool(c.get("qkv_bias", True)),
    )
    return fields


def _qwen3_moe(c: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: q/k RMSNorm per head, a head_dim of its own (128 at hidden 2048 and 32 heads),
    no shared expert."""
    fields = _qwen_moe(c)
    fields.update(attention_bias=bool(c.get("attention_bias", False)), qk_norm="head")
    return fields


def _qwen_moe(c: Mapping[str, Any]) -> dict[str, Any]:
    """What Qwen2-MoE and Qwen3-MoE share: experts of moe_intermediate_size, a router that
    rounds its top-k weights to the model's dtype, dense layers where the config lists them,
    full attention."""
    if c.get("use_sliding_window"):
        raise HrmError("use_sliding_window true: sliding-window attention is not supported")
    return _llama_like(c, "moe_intermediate_size", _num_experts(c)) | dict(
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(c, 1e6)),
        renormalize_top_k=bool(c.get("norm_topk_prob", False)),
        round_router_weights=True,
        **_dense_layers(c),
    )


def _num_experts(c: Mapping[str, Any]) -> int:
    """num_experts, which transformers 5.x writes as num_local_experts for Qwen and OLMoE."""
    if "num_experts" in c:
        return c["num_experts"]
    if "num_local_experts" in c:
        return c["num_local_experts"]
    raise KeyError("num_experts")


def _dense_layers(c: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen's dense layers among sparse ones, as transformers picks them: a layer is dense when
    it is in mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step; its MLP is
    intermediate_size wide."""
    listed = c.get("mlp_only_layers") or []
    step = c.get("decoder_sparse_step", 1)
    step = 1 if step is None else step
    if not isinstance(listed, list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in listed
    ):
        raise HrmError(f"mlp_only_layers must be a list of layer indices, got {listed!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise HrmError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    layers = c["num_hidden_layers"]
    dense = tuple(i for i in range(layers) if i in listed or (i + 1) % step)
    if not dense:
        return {}
    if len(dense) == layers:
        raise HrmError(
            f"mlp_only_layers {listed} and decoder_sparse_step {step} make every layer dense: "
            "that is not a mixture of experts"
        )
    return {"dense_layers": dense, "dense_intermediate_size": c["intermediate_size"]}


def _olmoe(c: Mapping[str, Any]) -> dict[str, Any]:
    """OLMoE: q/k RMSNorm over the whole projection, Mixtral's layout under Qwen's names."""
    fields = _mixtral({**c, "num_local_experts": _num_experts(c)})
    fields.update(
        renormalize_top_k=bool(c.get("norm_topk_prob", False)),
        round_router_weights=True,
        qk_norm="projection",
        attention_bias=bool(c.get("attention_bias", False)),
        clip_qkv=c.get("clip_qkv"),
        rope_theta=float(_rope_theta(c, 10000.0)),
    )
    return fields


def _gpt_oss(c: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss: sinks, sliding layers where layer_types says, biases everywhere, the clamped GLU,
    a biased router that softmaxes its top k, YaRN rotary, norms scaled in fp32."""
    fields = _mixtral({**c, "num_local_experts": _num_experts(c)})
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    if (
        not isinstance(types, list)
        or len(types) != c["num_hidden_layers"]
        or any(t not in LAYER_TYPES for t in types)
    ):
        raise HrmError(
            f"layer_types must list one of {LAYER_TYPES} per layer "
            f"({c['num_hidden_layers']}), got {types!r}"
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    fields.update(
        norm="rmsnorm_fp32",
        rope_theta=float(_rope_theta(c, 150000.0)),
        attention_bias=bool(c.get("attention_bias", True)),
        output_bias=bool(c.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=c.get("sliding_window") if sliding else None,
        sliding_layers=sliding,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        routing="topk_softmax",
        renormalize_top_k=False,
        rope_scaling=rope_scaling(c),
    )
    return fields


def _glm4_moe(c: Mapping[str, Any]) -> dict[str, Any]:
    """GLM-4.5: q/k/v biases, rotary over a part of each head, optional q/k norms per head,
    sigmoid routing in groups with a choice-only bias, an ungated shared expert, the first
    first_k_dense_replace layers dense. The multi-token-prediction layers the checkpoints carry
    past num_hidden_layers are not part of greedy generation and are not read."""
    experts = c.get("n_routed_experts") or _num_experts(c)
    fields = _llama_like(c, "moe_intermediate_size", experts)
    params = c.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    fields.update(
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=float(_rope_theta(c, 10000.0)),
        rope_scaling=rope_scaling(c),
        rotary_dim=int(fields["head_dim"] * float(partial)),
        attention_bias=bool(c.get("attention_bias", False)),
        qk_norm="head" if c.get("use_qk_norm") else None,
        routing="sigmoid_groups",
        router_bias=True,
        n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        renormalize_top_k=bool(c.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=c["moe_intermediate_size"] * c.get("n_shared_experts", 0),
        shared_expert_gate=False,
    )
    return fields | _first_dense(c)


def _first_dense(c: Mapping[str, Any]) -> dict[str, Any]:
    """GLM's and DeepSeek's dense layers: the first first_k_dense_replace, of intermediate_size."""
    layers, first = c["num_hidden_layers"], c.get("first_k_dense_replace", 0)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < layers:
        raise HrmError(
            f"first_k_dense_replace must be 0..{layers - 1} (a layer must stay sparse), "
            f"got {first!r}"
        )
    if not first:
        return {}
    return {"dense_layers": tuple(range(first)), "dense_intermediate_size": c["intermediate_size"]}


def _deepseek(c: Mapping[str, Any]) -> dict[str, Any]:
    """What DeepSeek-V2 and -V3 share: multi-head latent attention (hrm.arch.ModelArch's
    kv_lora_rank), YaRN rotary over qk_rope_head_dim with the softmax scaled by its mscale
    squared, shared experts without a gate, the first first_k_dense_replace layers dense. The
    multi-token-prediction layers V3 carries past num_hidden_layers are not part of greedy
    generation and are not read."""
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise HrmError(f"{flag} true is not supported for {c['model_type']}")
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        positive_int(c[name], where=name)
    rope, latent, nope = c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_nope_head_dim"]
    scaling = rope_scaling(c)
    fields = _llama_like({**c, "num_key_value_heads": 1, "head_dim": latent + rope},
                         "moe_intermediate_size", c["n_routed_experts"])  # fmt: skip
    fields.update(
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(c, 10000.0)),
        rope_scaling=scaling,
        rotary_dim=rope,
        kv_lora_rank=latent,
        q_lora_rank=c.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        v_head_dim=c["v_head_dim"],
        softmax_scale=(nope + rope) ** -0.5 * _mscale_all_dim(dict(scaling)) ** 2,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=c["moe_intermediate_size"] * c.get("n_shared_experts", 0),
        shared_expert_gate=False,
    )
    return fields | _first_dense(c)


def _mscale_all_dim(y: dict) -> float:
    """YaRN's mscale at mscale_all_dim, which DeepSeek folds into its softmax scale twice
    (transformers' yarn_apply_mscale); 1 without YaRN or that field."""
    factor, m = y.get("factor") or 1.0, y.get("mscale_all_dim")
    return 0.1 * m * math.log(factor) + 1.0 if m and factor > 1 else 1.0


def _deepseek_v2(c: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2: softmax router in fp32, top k (topk_method greedy) or top k within the best
    topk_group of n_group groups (group_limited_greedy), scaled, not renormalised (transformers
    reads no norm_topk_prob for V2); rotary over interleaved pairs."""
    method = c.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise HrmError(
            f"topk_method {method!r} is not supported; supported: greedy, group_limited_greedy"
        )
    grouped = method == "group_limited_greedy"
    return _deepseek(c) | dict(
        routing="softmax_groups",
        renormalize_top_k=False,
        n_group=(c.get("n_group") or 1) if grouped else 1,
        topk_group=(c.get("topk_group") or 1) if grouped else 1,
        rope_interleave=True,
    )


def _deepseek_v3(c: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3: GLM-4.5's router (sigmoid, e_score_correction_bias for the choice, groups by
    their two best, renormalised, scaled); rotary interleaved unless rope_interleave is false."""
    return _deepseek(c) | dict(
        routing="sigmoid_groups",
        router_bias=True,
        n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1,
        renormalize_top_k=bool(c.get("norm_topk_prob", True)),
        rope_interleave=bool(c.get("rope_interleave", True)),
    )


def rope_scaling(c: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """rope_scaling (or transformers 5.x's rope_parameters) as sorted (field, value) pairs: ()
    for plain rotary, YaRN's fields with their defaults filled in; other kinds are refused."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise HrmError(f"rope_scaling must be an object or null, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return ()
    if kind != "yarn":
        raise HrmError(f"rope_type {kind!r} is not supported; supported: default, yarn")
    values = {name: params.get(name, default) for name, default in YARN_FIELDS.items()}
    if values["factor"] is None or values["original_max_position_embeddings"] is None:
        raise HrmError(
            "rope_scaling of type yarn needs factor and original_max_position_embeddings"
        )
    return (("rope_type", "yarn"), *sorted(values.items()))


def eos_token_ids(config: Mapping[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """`eos_token_id` of a config.json or generation_config.json: an int, a list of ints or null."""
    value = config.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HrmError(
                f"{where}: eos_token_id must be a token id or a list of them, got {value!r}"
            )
    return tuple(values)


def _rope_theta(c: Mapping[str, Any], default: float) -> float:
    """transformers 5.x moved rope_theta into rope_parameters; read either."""
    params = c.get("rope_parameters") or {}
    return params.get("rope_theta", c.get("rope_theta", default))


PARSERS = {
    "mixtral": _mixtral,
    "dbrx": _dbrx,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}
assert set(PARSERS) == set(MODEL_TYPES)
