"""Open a local Mixtral, DBRX, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss or GLM-4.5 checkpoint into one
canonical set of per-layer weights.

Three on-disk layouts (docs/architecture.md) become the same `ModelWeights`: every tensor is a
view of the memory-mapped safetensors file when it already has the requested dtype (its pages
read in at load, not in the run's timed steps), or is copied once into that dtype (and the file
pages released) when it has not, so loading never holds two copies.  Each expert's w1, w3 and
w2 are separate tensors, addressable on their own, because the offloading pipeline moves experts
one at a time.  All weights use the linear layout [out, in].
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.checkpoint_files import Tensors, open_shards
from executor.safetensors_mmap import SafetensorsFile
from executor.stored_formats import check_stored_format
from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.gguf_file import is_gguf, read_gguf
from hrm.hf_config import eos_token_ids
from hrm.io import load_json
from hrm.policy import FLOAT_DTYPES
from hrm.rules.placement import dense_shapes

TORCH_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    w1: torch.Tensor  # [I, H] gate projection
    # [I, H] up projection; None where w1 holds gate and up stacked, [2I, H]: a packed model's
    # (executor/packed_weights.py), one GEMM for both
    w3: torch.Tensor | None
    w2: torch.Tensor  # [H, I] down projection
    b1: torch.Tensor | None = None  # [I] biases of the three (gpt-oss)
    b3: torch.Tensor | None = None  # [I]
    b2: torch.Tensor | None = None  # [H]


@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor  # [nq*D, H] (latent attention: [nq*(nope+rope), H or q_lora_rank])
    wk: torch.Tensor | None = None  # [nkv*D, H]; None in latent attention
    wv: torch.Tensor | None = None  # [nkv*D, H]; None in latent attention
    wo: torch.Tensor  # [H, nq*D] (latent attention: [H, nq*v_head_dim])
    ffn_norm: torch.Tensor  # [H]
    experts: tuple[ExpertWeights, ...]  # a dense layer's MLP is its one expert
    router: torch.Tensor | None = None  # [E, H]; None in a dense layer (all tokens, weight 1)
    # what some families add (hrm.rules.placement.dense_shapes lists a family's): q/k/v biases
    # (Qwen2-MoE), q/k RMSNorm weights [D] per head (Qwen3-MoE) or [nq*D], [nkv*D] (OLMoE), and a
    # shared expert with its sigmoid gate [1, H] (Qwen2-MoE)
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    shared_w1: torch.Tensor | None = None
    shared_w3: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # [H] the O projection's bias (gpt-oss)
    router_bias: torch.Tensor | None = None  # [E] (gpt-oss)
    # [nq] a learned logit per head in each softmax's denominator (gpt-oss): the model's attention
    # state (MoEModel keeps it where attention runs), not among the weights a store places
    sinks: torch.Tensor | None = None
    # latent attention (DeepSeek; hrm.rules.placement._latent_attention_shapes): q's low rank
    # [q_lora, H] and its norm, the latent and rotary key [kv_lora + rope, H], the latent's norm
    # [kv_lora] and its up-projection to each head's key and value [nq*(nope + v), kv_lora]
    wq_a: torch.Tensor | None = None
    q_a_norm: torch.Tensor | None = None
    wkv_a: torch.Tensor | None = None
    kv_a_norm: torch.Tensor | None = None
    wkv_b: torch.Tensor | None = None
    # wkv_b as the absorbed form reads it, set in its place where the CPU holds the model
    # (executor/latent_attention.py absorbed_layout): each head's key part [nq, nope, kv_lora]
    # and value part transposed [nq, kv_lora, v], each contiguous
    wk_b: torch.Tensor | None = None
    wv_b: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied


def _mixtral_layer(t: Tensors, arch: ModelArch, layer: int) -> LayerWeights:
    p = f"model.layers.{layer}."
    if t.has(p + "mlp.experts.gate_up_proj"):  # the fused layout transformers 5.x can save
        experts, router = _fused_experts(t, arch, p + "mlp."), p + "mlp.gate.weight"
    else:  # the original per-expert names
        x = p + "block_sparse_moe."
        experts, router = _experts(t, arch, x + "experts.", ("w1", "w3", "w2")), x + "gate.weight"
    return _layer(t, arch, p, router, experts)


def _qwen_layer(t: Tensors, arch: ModelArch, layer: int, **renamed: str) -> LayerWeights:
    """Qwen2-MoE, Qwen3-MoE, OLMoE and GLM-4.5: Mixtral's attention names, experts under mlp; a
    dense layer's MLP (mlp.gate_proj, up_proj, down_proj) read as its one expert; GLM's shared
    experts under mlp.shared_experts and its router's bias as mlp.gate.e_score_correction_bias;
    `renamed` as _layer's (DeepSeek's attention)."""
    p = f"model.layers.{layer}."
    kind = arch.layer_arch(layer)
    if kind.ffn_is_dense:
        mlp = _experts(t, kind, p, ("gate_proj", "up_proj", "down_proj"), ["mlp"])
        return _layer(t, kind, p, None, mlp, **renamed)
    if t.has(p + "mlp.experts.gate_up_proj"):
        experts = _fused_experts(t, kind, p + "mlp.")
    else:
        experts = _experts(t, kind, p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"))
    if arch.model_type not in ("glm4_moe", "deepseek_v2", "deepseek_v3"):
        return _layer(t, kind, p, p + "mlp.gate.weight", experts)
    shared = {f"shared_{w}": f"{p}mlp.shared_experts.{n}_proj.weight"
              for w, n in (("w1", "gate"), ("w3", "up"), ("w2", "down"))}  # fmt: skip
    bias = p + "mlp.gate.e_score_correction_bias"
    return _layer(t, kind, p, p + "mlp.gate.weight", experts, router_bias=bias, **shared, **renamed)


def _gpt_oss_layer(t: Tensors, arch: ModelArch, layer: int) -> LayerWeights:
    """gpt-oss: Llama-style attention with biases and sinks, a biased router under mlp.router;
    experts fused as transformers keeps them (gate_up_proj [E, H, 2I], down_proj [E, I, H]:
    input-major, gate and up interleaved) or as released, in MXFP4 blocks (output-major). Each
    expert's projections are copied out contiguous, the file's pages dropped after."""
    p, x = f"model.layers.{layer}.", f"model.layers.{layer}.mlp.experts."
    H, inter, E = arch.hidden_size, arch.intermediate_size, arch.num_experts
    if t.has(x + "gate_up_proj_blocks") or t.has(x + "gate_up_proj_scales"):
        gate_up, down = (
            t.mxfp4(x + "gate_up_proj", (E, 2 * inter, H)),
            t.mxfp4(x + "down_proj", (E, H, inter)),
        )
    else:
        fused = t.get(x + "gate_up_proj", (E, H, 2 * inter)), t.get(x + "down_proj", (E, inter, H))
        gate_up, down = (lambda e, w=w: w[e].t() for w in fused)
    gate_up_bias = t.get(x + "gate_up_proj_bias", (E, 2 * inter))
    down_bias = t.get(x + "down_proj_bias", (E, H))
    experts = []
    for e in range(E):
        gu = gate_up(e)  # [2I, H], rows gate, up, gate, up, ...
        experts.append(ExpertWeights(
            w1=gu[0::2].contiguous(), w3=gu[1::2].contiguous(), w2=down(e).contiguous(),
            b1=gate_up_bias[e, 0::2].contiguous(), b3=gate_up_bias[e, 1::2].contiguous(),
            b2=down_bias[e],
        ))  # fmt: skip
    for name in t.where:
        if name.startswith(x) and not name.endswith("down_proj_bias"):
            t.release(name)
    w = _layer(t, arch, p, p + "mlp.router.weight", tuple(experts))
    sinks = t.get(p + "self_attn.sinks", (arch.num_attention_heads,))
    return dataclasses.replace(w, sinks=sinks)


def _deepseek_layer(t: Tensors, arch: ModelArch, layer: int) -> LayerWeights:
    """DeepSeek-V2/V3: latent attention under self_attn (q_proj, or q_a_proj, q_a_layernorm and
    q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj), then Qwen's MLP names with GLM's
    shared experts and (V3) router bias."""
    a = f"model.layers.{layer}.self_attn."
    names = {"wq_a": a + "q_a_proj.weight", "q_a_norm": a + "q_a_layernorm.weight",
             "wq": a + ("q_b_proj.weight" if arch.q_lora_rank else "q_proj.weight"),
             "wkv_a": a + "kv_a_proj_with_mqa.weight", "kv_a_norm": a + "kv_a_layernorm.weight",
             "wkv_b": a + "kv_b_proj.weight"}  # fmt: skip
    return _qwen_layer(t, arch, layer, **names)


def _layer(
    t: Tensors, arch: ModelArch, p: str, router: str | None, experts, **renamed: str
) -> LayerWeights:
    """A layer under the Llama-style names, with what its family adds (dense_shapes); `renamed`:
    field -> tensor name where a family names one otherwise."""
    a = p + "self_attn."
    names = {"wq": a + "q_proj.weight", "wk": a + "k_proj.weight", "wv": a + "v_proj.weight",
             "wo": a + "o_proj.weight", "bq": a + "q_proj.bias", "bk": a + "k_proj.bias",
             "bv": a + "v_proj.bias", "q_norm": a + "q_norm.weight", "k_norm": a + "k_norm.weight",
             "attn_norm": p + "input_layernorm.weight", "router": router,
             "ffn_norm": p + "post_attention_layernorm.weight",
             "shared_w1": p + "mlp.shared_expert.gate_proj.weight",
             "shared_w3": p + "mlp.shared_expert.up_proj.weight",
             "shared_w2": p + "mlp.shared_expert.down_proj.weight",
             "shared_gate": p + "mlp.shared_expert_gate.weight", "bo": a + "o_proj.bias",
             "router_bias": router and router.removesuffix("weight") + "bias"}  # fmt: skip
    names |= renamed
    shapes = dense_shapes(arch)
    return LayerWeights(**{n: t.get(names[n], shape) for n, shape in shapes.items()},
                        experts=experts)  # fmt: skip


def _experts(
    t: Tensors, arch: ModelArch, prefix: str, names, experts=None
) -> tuple[ExpertWeights, ...]:
    """Experts stored one tensor per projection: {prefix}{e}.{gate, up, down}.weight for e in
    `experts` (default 0 .. E-1)."""
    H, inter = arch.hidden_size, arch.intermediate_size
    gate, up, down = names
    return tuple(
        ExpertWeights(
            w1=t.get(f"{prefix}{e}.{gate}.weight", (inter, H)),
            w3=t.get(f"{prefix}{e}.{up}.weight", (inter, H)),
            w2=t.get(f"{prefix}{e}.{down}.weight", (H, inter)),
        )
        for e in (range(arch.num_experts) if experts is None else experts)
    )


def _fused_experts(t: Tensors, arch: ModelArch, prefix: str) -> tuple[ExpertWeights, ...]:
    """The layout transformers 5.x writes for its fused experts: experts.gate_up_proj
    [E, 2I, H] and experts.down_proj [E, H, I]; each expert a view."""
    H, inter, E = arch.hidden_size, arch.intermediate_size, arch.num_experts
    gate_up = t.get(prefix + "experts.gate_up_proj", (E, 2 * inter, H))
    down = t.get(prefix + "experts.down_proj", (E, H, inter))
    return tuple(
        ExpertWeights(w1=gate_up[e, :inter], w3=gate_up[e, inter:], w2=down[e]) for e in range(E)
    )


def _dbrx_layer(t: Tensors, arch: ModelArch, layer: int) -> LayerWeights:
    p = f"transformer.blocks.{layer}."
    H, inter, E = arch.hidden_size, arch.intermediate_size, arch.num_experts
    Q, KV = arch.q_size, arch.kv_size
    wqkv = t.get(p + "norm_attn_norm.attn.Wqkv.weight", (Q + 2 * KV, H))
    # DBRX stacks experts along rows: w1 (gate), v1 (up) and w2 are [E*I, H]; w2 is the
    # transpose of a linear weight, so its [H, I] view is a transposed view, not a copy.
    mlp = p + "ffn.experts.mlp."
    w1, v1, w2 = (t.get(mlp + n, (E * inter, H)).view(E, inter, H) for n in ("w1", "v1", "w2"))
    return LayerWeights(
        attn_norm=t.get(p + "norm_attn_norm.norm_1.weight", (H,)),
        wq=wqkv[:Q],
        wk=wqkv[Q : Q + KV],
        wv=wqkv[Q + KV :],
        wo=t.get(p + "norm_attn_norm.attn.out_proj.weight", (H, Q)),
        ffn_norm=t.get(p + "norm_attn_norm.norm_2.weight", (H,)),
        router=t.get(p + "ffn.router.layer.weight", (E, H)),
        experts=tuple(ExpertWeights(w1=w1[e], w3=v1[e], w2=w2[e].t()) for e in range(E)),
    )


_LLAMA_NAMES = ("model.embed_tokens.weight", "model.norm.weight")
_GLOBAL_NAMES = {  # model_type -> (embedding, final norm)
    "mixtral": _LLAMA_NAMES,
    "dbrx": ("transformer.wte.weight", "transformer.norm_f.weight"),
    "qwen2_moe": _LLAMA_NAMES,
    "qwen3_moe": _LLAMA_NAMES,
    "olmoe": _LLAMA_NAMES,
    "gpt_oss": _LLAMA_NAMES,
    "glm4_moe": _LLAMA_NAMES,
    "deepseek_v2": _LLAMA_NAMES,
    "deepseek_v3": _LLAMA_NAMES,
}
_LAYER_READERS: dict[str, Callable[[Tensors, ModelArch, int], LayerWeights]] = {
    "mixtral": _mixtral_layer,
    "dbrx": _dbrx_layer,
    "qwen2_moe": _qwen_layer,
    "qwen3_moe": _qwen_layer,
    "olmoe": _qwen_layer,
    "gpt_oss": _gpt_oss_layer,
    "glm4_moe": _qwen_layer,
    "deepseek_v2": _deepseek_layer,
    "deepseek_v3": _deepseek_layer,
}
SUPPORTED_MODEL_TYPES = tuple(_LAYER_READERS)  # what the executor reads (the planner: hf_config)


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    directory: Path | None  # None: random weights made in memory (random_checkpoint)
    arch: ModelArch
    weights: ModelWeights
    dtype: torch.dtype
    files: tuple = ()  # the safetensors files its tensors are views of (SafetensorsFile)

    def source(self, tensor: torch.Tensor) -> tuple[Path, int] | None:
        """(file, offset) of a tensor that is a contiguous view of one of the checkpoint's files
        (the disk tier reads those in place), else None."""
        for f in self.files:
            offset = f.source(tensor)
            if offset is not None:
                return f.path, offset
        return None

    @property
    def expert_gate_weights(self) -> list[torch.Tensor]:
        """Every expert's w1 [I, H], layer by layer: what a CPU GEMM probe rotates over."""
        return [e.w1 for layer in self.weights.layers for e in layer.experts]


def load_tokenizer(directory: Path):
    """The checkpoint's own tokenizer, or None when it ships none (then prompts are token ids);
    a GGUF file's from its metadata (executor/gguf_tokenizer.py)."""
    if is_gguf(directory):
        from executor.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(directory)
    if not any((directory / n).is_file() for n in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise HrmError(
            f"{directory}: cannot load its tokenizer ({exc}); fix or remove it"
        ) from None


def read_arch(directory: str | os.PathLike) -> ModelArch:
    """The checkpoint's ModelArch, with the stop tokens of generation_config.json when present."""
    return _read_config(Path(directory))[0]


def _read_config(directory: Path):
    """(ModelArch, stored format: check_stored_format's) of a checkpoint's config.json (a GGUF
    file's header), read once and refused in one line where the executor cannot run it."""
    if is_gguf(directory):
        return ModelArch.from_hf_config(*read_gguf(directory).described()), None
    if not directory.is_dir():
        raise HrmError(f"{directory}: no such checkpoint directory; check the path")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise HrmError(f"{config_path}: missing; a checkpoint directory needs its config.json")
    config = load_json(config_path)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HrmError(
            f"{config_path}: model_type {model_type!r} cannot be run; the executor runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    stored = check_stored_format(config, model_type, str(config_path))
    arch = ModelArch.from_hf_config(config, name=directory.name, where=str(config_path))
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        stops = eos_token_ids(load_json(generation_path), where=str(generation_path))
        if stops:
            arch = dataclasses.replace(arch, eos_token_ids=stops)
    return arch, stored


def stored_dtype(directory: Path, arch: ModelArch) -> str:
    """The dtype the embedding is stored in: a run's dtype when none is asked for (bfloat16
    where a GGUF file stores it quantized)."""
    if is_gguf(directory):
        kind = read_gguf(directory).tensors["token_embd.weight"].kind
        return {"F32": "float32", "F16": "float16"}.get(kind, "bfloat16")
    embed_name = _GLOBAL_NAMES[arch.model_type][0]
    for f in open_shards(directory):
        if embed_name in f.keys():
            return str(f.dtype(embed_name)).removeprefix("torch.")
    raise HrmError(f"{directory}: tensor {embed_name} is missing from the checkpoint")


def open_checkpoint(
    directory: str | os.PathLike, dtype: str | None = None, device: str = "cpu"
) -> Checkpoint:
    """Map a checkpoint directory; `dtype` None keeps the dtype the embedding is stored in."""
    directory = Path(directory)
    arch, stored = _read_config(directory)
    dtype = dtype or stored_dtype(directory, arch)
    if dtype not in TORCH_DTYPES:
        raise HrmError(f"unknown dtype {dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
    embed_name, norm_name = _GLOBAL_NAMES[arch.model_type]
    shards = None
    if is_gguf(directory):
        from executor.gguf_tensors import GgufShard

        shards = [GgufShard(read_gguf(directory), arch, TORCH_DTYPES[dtype])]
    t = Tensors(directory, TORCH_DTYPES[dtype], device, fp8_block=stored and stored[1],
                shards=shards)  # fmt: skip
    H, V = arch.hidden_size, arch.vocab_size
    embed = t.get(embed_name, (V, H))
    weights = ModelWeights(
        embed=embed,
        layers=tuple(_LAYER_READERS[arch.model_type](t, arch, i) for i in range(arch.num_layers)),
        final_norm=t.get(norm_name, (H,)),
        lm_head=embed if arch.tie_word_embeddings else t.get("lm_head.weight", (V, H)),
    )
    files = tuple({id(f): f for f in t.where.values() if isinstance(f, SafetensorsFile)}.values())
    return Checkpoint(directory=directory, arch=arch, weights=weights, dtype=t.dtype, files=files)


# the standard deviation transformers draws these families' linear weights from
# (initializer_range); every random-weight builder draws from it
INIT_STD = 0.02


def init_kind(name: str, ndim: int) -> str:
    """How transformers initialises a weight, by its name and rank: a norm's weight to ones, any
    other vector (a bias) to zeros, a matrix from N(0, INIT_STD^2). The one rule of the three
    random-weight builders (random_checkpoint here, executor/overhead.py's shared-expert
    miniature, and hrm validate's checkpoint saved by transformers)."""
    if "norm" in name:
        return "ones"
    return "zeros" if ndim == 1 else "normal"


def random_checkpoint(
    arch: ModelArch, dtype: str, seed: int = 0, device: str = "cpu"
) -> Checkpoint:
    """The architecture with random weights made in memory (`hrm run --random-weights`): what
    speed is measured on where real weights cannot be downloaded, initialised as transformers
    does (init_kind); every tensor its own allocation, as if loaded.
    Layers after the first of each kind (sparse, dense) are copies of it: a speed run needs
    every layer's bytes, not new random numbers, and copying is ~50x faster than drawing (a
    32-layer Mixtral in seconds)."""
    if dtype not in TORCH_DTYPES:
        raise HrmError(f"unknown dtype {dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
    from hrm.rules.placement import expert_shapes

    torch_dtype = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:  # drawn in place: no fp32 transient to count
        return torch.empty(shape, dtype=torch_dtype).normal_(0.0, INIT_STD, generator=g).to(device)

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=torch_dtype, device=device)

    H = arch.hidden_size

    def dense_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        kind = init_kind(name, len(shape))
        if kind == "normal":
            return weight(*shape)
        fill = torch.ones if kind == "ones" else torch.zeros
        return fill(shape, dtype=torch_dtype, device=device)

    def new_layer(kind: ModelArch) -> LayerWeights:
        expert = expert_shapes(kind)
        sinks = dense_tensor("sinks", (kind.num_attention_heads,)) if kind.attention_sinks else None
        return LayerWeights(
            **{n: dense_tensor(n, shape) for n, shape in dense_shapes(kind).items()},
            experts=tuple(
                ExpertWeights(**{n: dense_tensor(n, shape) for n, shape in expert.items()})
                for _ in range(kind.num_experts)
            ),
            sinks=sinks,
        )

    def clones(w):
        return {f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w)
                if isinstance(getattr(w, f.name), torch.Tensor)}  # fmt: skip

    def copy(w: LayerWeights) -> LayerWeights:
        experts = tuple(ExpertWeights(**clones(e)) for e in w.experts)
        return dataclasses.replace(w, **clones(w), experts=experts)

    firsts: dict[bool, LayerWeights] = {}
    layers = []
    for i in range(arch.num_layers):
        dense = arch.is_dense(i)
        layers.append(copy(firsts[dense]) if dense in firsts else new_layer(arch.layer_arch(i)))
        firsts.setdefault(dense, layers[-1])
    embed = weight(arch.vocab_size, H)
    weights = ModelWeights(
        embed=embed,
        layers=tuple(layers),
        final_norm=ones(H),
        lm_head=embed if arch.tie_word_embeddings else weight(arch.vocab_size, H),
    )
    return Checkpoint(directory=None, arch=arch, weights=weights, dtype=torch_dtype)
