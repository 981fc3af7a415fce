"""Tiny GGUF files written from tiny Hugging Face checkpoints with the `gguf` package, laid out as
llama.cpp's convert_hf_to_gguf.py lays them out: its metadata keys, its tensor names, experts
stacked [E, out, in], Mixtral's q and k rows permuted for its rotary, DeepSeek's kv_b_proj split
into attn_k_b (transposed) and attn_v_b. Written independently of the reader
(executor/gguf_tensors.py), so that a mistake in one is not undone by the same mistake in the
other; both were checked against files from llama.cpp's own converter (docs/decisions.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}  # fmt: skip
_RENAMES = [  # Hugging Face name (a regex over the layer's suffix) -> GGUF name
    (r"input_layernorm", "attn_norm"), (r"post_attention_layernorm", "ffn_norm"),
    (r"self_attn\.q_proj", "attn_q"), (r"self_attn\.k_proj", "attn_k"),
    (r"self_attn\.v_proj", "attn_v"), (r"self_attn\.o_proj", "attn_output"),
    (r"self_attn\.q_norm", "attn_q_norm"), (r"self_attn\.k_norm", "attn_k_norm"),
    (r"self_attn\.q_a_proj", "attn_q_a"), (r"self_attn\.q_a_layernorm", "attn_q_a_norm"),
    (r"self_attn\.q_b_proj", "attn_q_b"), (r"self_attn\.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
    (r"self_attn\.kv_a_layernorm", "attn_kv_a_norm"),
    (r"(block_sparse_moe|mlp)\.gate", "ffn_gate_inp"),
    (r"mlp\.shared_experts?\.gate_proj", "ffn_gate_shexp"),
    (r"mlp\.shared_experts?\.up_proj", "ffn_up_shexp"),
    (r"mlp\.shared_experts?\.down_proj", "ffn_down_shexp"),
    (r"mlp\.shared_expert_gate", "ffn_gate_inp_shexp"),
    (r"mlp\.gate_proj", "ffn_gate"), (r"mlp\.up_proj", "ffn_up"), (r"mlp\.down_proj", "ffn_down"),
]  # fmt: skip
_EXPERT = re.compile(
    r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)"
)
_STACKED = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps",
            "up_proj": "ffn_up_exps", "w2": "ffn_down_exps",
            "down_proj": "ffn_down_exps"}  # fmt: skip


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tensors(src: Path, c: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, as float32 arrays."""
    sd = {n: t.float().numpy() for n, t in load_file(src / "model.safetensors").items()}
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"),
           "output_norm.weight": sd.pop("model.norm.weight")}  # fmt: skip
    if "lm_head.weight" in sd:
        out["output.weight"] = sd.pop("lm_head.weight")
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in sd.items():
        layer, rest = re.match(r"model\.layers\.(\d+)\.(.*)", name).groups()
        kind = rest.rsplit(".", 1)[1]
        if m := _EXPERT.match(rest):
            experts.setdefault((int(layer), _STACKED[m[2]]), {})[int(m[1])] = w
        elif rest.startswith("self_attn.kv_b_proj"):
            out |= _split_kv_b(layer, w, c)
        elif rest.endswith("e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        else:
            gg = next(g for pat, g in _RENAMES if re.fullmatch(pat, rest.rsplit(".", 1)[0]))
            if c["model_type"] == "mixtral" and gg in ("attn_q", "attn_k"):
                heads = c["num_attention_heads" if gg == "attn_q" else "num_key_value_heads"]
                w = _permute(w, heads)
            out[f"blk.{layer}.{gg}.{kind}"] = w
    for (layer, gg), by_expert in experts.items():
        out[f"blk.{layer}.{gg}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _split_kv_b(layer: str, w: np.ndarray, c: dict) -> dict[str, np.ndarray]:
    heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
    per_head = w.reshape(heads, nope + v, w.shape[1])
    return {f"blk.{layer}.attn_k_b.weight": per_head[:, :nope].transpose(0, 2, 1).copy(),
            f"blk.{layer}.attn_v_b.weight": per_head[:, nope:].copy()}  # fmt: skip


def _metadata(writer, c: dict, arch: str) -> None:
    w = writer
    rope = c.get("rope_parameters") or {}
    layers = c["num_hidden_layers"]
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else c["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c.get("num_local_experts") or c.get("num_experts") or c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("head_dim") and arch != "deepseek2":
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch == "deepseek2":
        _deepseek_metadata(w, c, rope)


def _deepseek_metadata(w, c: dict, rope: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters' keys."""
    import gguf

    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        w.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if c.get("n_group"):
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    if c["model_type"] == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c["qk_rope_head_dim"])


def byte_tokenizer_metadata(writer, vocab: int, eos: int | None = None) -> None:
    """A gpt2-style byte-level vocabulary: the 256 bytes, then merges of byte pairs up to
    `vocab`, and a chat template; `eos` its end-of-sequence id."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    tokens, merges = list(chars), []
    for a in "etaoinshr":
        for b in " etaoinshr":
            if len(tokens) < vocab - 1:
                left, right = chars[ord(a)], chars[ord(b)]
                merges.append(f"{left} {right}")
                tokens.append(left + right)
    tokens.append("<|end|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab])
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1 if eos is None else eos)
    writer.add_chat_template(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )


def write_gguf(
    src: Path, out: Path, kind: str = "F32", tokenizer: bool = False, split_tensors: int = 0
) -> Path:
    """The checkpoint at `src` as a GGUF file (split in parts of `split_tensors` tensors, named
    as llama.cpp names them, where given: the first part returned); `kind` the type of its
    matrices (F32, F16, Q8_0, Q4_0; routers, norms and vectors stay F32, as llama.cpp keeps
    them)."""
    import gguf

    c = json.loads((src / "config.json").read_text())
    arch = ARCH[c["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_tensors)
    _metadata(writer, c, arch)
    if tokenizer:
        byte_tokenizer_metadata(writer, c["vocab_size"])
    qtype = gguf.GGMLQuantizationType[kind]
    for name, w in _tensors(src, c).items():
        small = w.ndim == 1 or "ffn_gate_inp" in name or "norm" in name
        if kind == "F32" or small:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif kind == "F16":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return parts[0] if parts else out


def rewrite_gguf(src: Path, out: Path, change=None) -> Path:
    """A copy of the GGUF file `src` with its metadata as it was and each tensor as `change`
    (name, torch-order shape, the reader's tensor) returns it: (array, raw GGML type or None), or
    None to keep it as it is."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        changed = change(t.name, shape, t) if change is not None else None
        array, raw = changed if changed is not None else (np.array(t.data), t.tensor_type)
        writer.add_tensor(t.name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized_copy(src: Path, out: Path) -> Path:
    """A GGUF file with every tensor of `src` dequantized to F32 (by the gguf package) and its
    metadata as it was: what a quantized file must run exactly like."""
    import gguf

    def plain(name, shape, t):
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        return np.ascontiguousarray(values, dtype=np.float32), None

    return rewrite_gguf(src, out, plain)


def torch_of(path: Path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file, dequantized to float32, in torch's order."""
    import gguf

    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())
