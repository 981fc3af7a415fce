"""ModelArch: the geometry of a Mixture-of-Experts transformer, from a Hugging Face config.json.

The roofline, the planner and the executor all read the model through ModelArch; hrm/hf_config.py
is the one place that knows config field names (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hrm.errors import HrmError
from hrm.formats import is_compact, row_bytes
from hrm.hf_config import MODEL_TYPES, PARSERS, eos_token_ids
from hrm.io import load_json
from hrm.policy import dtype_bytes
from hrm.schema import positive_int

BUNDLED_DIR = Path(__file__).resolve().parent / "model_configs"
# the sizes that define a model's shape, each a positive integer, and (with the model type and
# whether the embedding is tied) what a plan is made for: ModelArch.geometry
COUNTS = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
          "num_key_value_heads", "head_dim", "num_experts", "experts_per_token",
          "vocab_size")  # fmt: skip
QK_NORMS = ("head", "projection")  # RMSNorm per head over d (Qwen3-MoE), or over nq*d (OLMoE)
# "rmsnorm" (Mixtral: scale after rounding back), "rmsnorm_fp32" (gpt-oss: scale in fp32, then
# round), "layernorm" (DBRX: LayerNorm without bias)
NORMS = ("rmsnorm", "rmsnorm_fp32", "layernorm")
# "softmax_topk": softmax over every expert, then the top k (Mixtral, Qwen, DBRX); "topk_softmax":
# the top k logits, then a softmax over those k (gpt-oss); "sigmoid_groups": sigmoid scores, the
# router's bias added for the choice only, the top k within the best topk_group of n_group
# groups, weights renormalised and scaled by routed_scaling_factor (DeepSeek-V3, GLM-4.5);
# "softmax_groups": softmax scores in fp32, each group ranked by its best score, the top k within
# the best topk_group groups, weights scaled by routed_scaling_factor (DeepSeek-V2)
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_groups", "softmax_groups")
GROUP_ROUTINGS = ("sigmoid_groups", "softmax_groups")
LATENT_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rotary_dim")


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int  # h1
    intermediate_size: int  # h2: width of one expert
    num_attention_heads: int  # nq
    num_key_value_heads: int  # nkv
    head_dim: int  # d
    num_experts: int  # n_e
    experts_per_token: int  # k
    vocab_size: int
    tie_word_embeddings: bool = False
    norm: str = "rmsnorm"  # one of NORMS
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    clip_qkv: float | None = None  # DBRX clamps q, k, v to [-clip, clip]
    router_norm_p: float | None = None  # DBRX divides the top-k weights by their p-norm
    renormalize_top_k: bool = True  # Mixtral renormalises the top-k softmax weights to sum 1
    # Qwen and OLMoE round the top-k weights to the model's dtype before scaling the experts
    round_router_weights: bool = False
    shared_expert_intermediate_size: int = 0  # an always-on expert (Qwen2-MoE, GLM-4.5)
    shared_expert_gate: bool = True  # Qwen2-MoE scales it by sigmoid(x @ gate); GLM does not
    # layers whose FFN is one dense MLP of dense_intermediate_size, with no router or experts
    # (Qwen's mlp_only_layers and decoder_sparse_step); indices past num_layers are dropped, so
    # a model cut to its first layers keeps the dense ones among them
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    attention_bias: bool = False  # qwen2_moe has biases on q, k, v
    qk_norm: str | None = None  # RMSNorm of q and k before rotary: one of QK_NORMS, or None
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these; () never stops early
    max_position_embeddings: int | None = None  # longest context the model was made for
    # what gpt-oss adds: a learned logit per head in each attention softmax's denominator (the
    # "sink"); layers whose queries see only the last `sliding_window` keys, themselves included;
    # biases on the O projection, the router and each expert's projections; the clamped GLU
    # (gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)); the router's
    # softmax over its top k logits; rotary frequencies rescaled by YaRN
    attention_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    output_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    routing: str = "softmax_topk"  # one of ROUTINGS
    # rope_scaling's fields as (name, value) pairs, sorted (hashable); () for plain rotary
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rotary_dim: int | None = None  # the leading dims of a head that rotate (GLM: half); None all
    n_group: int = 1  # sigmoid_groups routing's groups of experts, the best topk_group kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # multi-head latent attention (DeepSeek-V2/V3): each token's K and V come from one latent of
    # kv_lora_rank (RMS-normalised) and one rotary key of rotary_dim that every head shares. The
    # cache holds those two per token, as one key/value head of head_dim = kv_lora_rank +
    # rotary_dim whose values are its first kv_lora_rank columns; queries absorb the key
    # up-projection (per head, qk_nope_head_dim -> kv_lora_rank) and the attention output the
    # value one (kv_lora_rank -> v_head_dim) before the O projection. 0: not MLA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # queries through a low-rank projection and its RMSNorm; 0: direct
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary over interleaved pairs (x0, x1), (x2, x3), ...
    softmax_scale: float | None = None  # None: 1/sqrt(head_dim)

    def __post_init__(self) -> None:
        for name in COUNTS:
            positive_int(getattr(self, name), where=f"{self.name}: {name}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise HrmError(
                f"{self.name}: {self.num_attention_heads} attention heads are not a multiple of "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.qk_norm not in (None, *QK_NORMS):
            raise HrmError(f"{self.name}: qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")
        for field, allowed in (("norm", NORMS), ("routing", ROUTINGS)):
            if getattr(self, field) not in allowed:
                raise HrmError(
                    f"{self.name}: {field} {getattr(self, field)!r} is not one of {allowed}"
                )
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim:
            raise HrmError(
                f"{self.name}: rotary_dim {self.rotary_dim} is not in 1..{self.head_dim}"
            )
        sliding = tuple(sorted({i for i in self.sliding_layers if i < self.num_layers}))
        object.__setattr__(self, "sliding_layers", sliding)
        if sliding:
            positive_int(self.sliding_window, where=f"{self.name}: sliding_window")
        dense = tuple(sorted({i for i in self.dense_layers if i < self.num_layers}))
        if any(i < 0 for i in dense):
            raise HrmError(f"{self.name}: dense layer indices must be >= 0, got {dense}")
        object.__setattr__(self, "dense_layers", dense)
        if dense:
            positive_int(self.dense_intermediate_size, where=f"{self.name}: intermediate_size")
        if self.experts_per_token > self.num_experts:
            raise HrmError(
                f"{self.name}: {self.experts_per_token} experts per token exceeds "
                f"{self.num_experts} experts"
            )
        self._check_routing()
        self._check_latent_attention()

    def _check_latent_attention(self) -> None:
        if not self.kv_lora_rank:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "rotary_dim"):
            positive_int(getattr(self, name), where=f"{self.name}: {name}")
        if self.num_key_value_heads != 1 or self.head_dim != self.kv_lora_rank + self.rotary_dim:
            raise HrmError(
                f"{self.name}: latent attention caches one head of kv_lora_rank + rotary_dim "
                f"({self.kv_lora_rank} + {self.rotary_dim}), not {self.num_key_value_heads} of "
                f"{self.head_dim}"
            )

    def first_layers(self, layers: int | None) -> ModelArch:
        """The model cut to its first `layers` layers (`--layers`; None: all of them), as `hrm
        plan` plans and `hrm run --random-weights` runs it."""
        if layers is None:
            return self
        if not 1 <= layers <= self.num_layers:
            raise HrmError(
                f"--layers {layers}: {self.name} has {self.num_layers} layers; "
                f"give 1 to {self.num_layers}"
            )
        return dataclasses.replace(self, num_layers=layers)

    def _check_routing(self) -> None:
        groups, kept, e = self.n_group, self.topk_group, self.num_experts
        if self.routing not in GROUP_ROUTINGS or self.ffn_is_dense:
            return
        if e % groups or not 1 <= kept <= groups:
            raise HrmError(
                f"{self.name}: {e} experts in n_group {groups} groups, topk_group {kept}: the "
                "groups must divide the experts and topk_group be 1..n_group"
            )
        if self.experts_per_token > kept * (e // groups):
            raise HrmError(
                f"{self.name}: {self.experts_per_token} experts per token from {kept} groups "
                f"of {e // groups}"
            )

    # -- attention windows ---------------------------------------------------------------------

    def window(self, layer: int) -> int | None:
        """The keys a query of `layer` sees, itself included (None: every earlier one)."""
        return self.sliding_window if layer in self.sliding_layers else None

    def mean_keys(self, context):
        """Keys a query reads at `context` (a number or an array of them), averaged over the
        layers: what decode attention reads, a sliding layer at most its window."""
        sliding = len(self.sliding_layers)
        if not sliding:
            return context
        full = self.num_layers - sliding
        return (
            full * context + sliding * np.minimum(context, self.sliding_window)
        ) / self.num_layers

    # -- kinds of layer ------------------------------------------------------------------------

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    @property
    def ffn_is_dense(self) -> bool:
        """Every layer's FFN is one dense MLP: the view `layer_kinds` gives of the dense layers."""
        return len(self.dense_layers) == self.num_layers

    def layer_kinds(self) -> list[tuple[ModelArch, int]]:
        """(geometry, count) of each kind of layer, sparse then dense; each geometry is a model
        whose layers are all of that kind, so everything priced or placed per layer applies to
        it unchanged. A dense layer is one expert that every token takes with weight 1, without
        a router: that is what its MLP computes, and how the executor runs it."""
        dense = len(self.dense_layers)
        kinds = []
        if dense < self.num_layers:
            sparse = dataclasses.replace(self, num_layers=self.num_layers - dense, dense_layers=())
            kinds.append((sparse, self.num_layers - dense))
        if dense:
            kinds.append((self._dense_kind(dense), dense))
        return kinds

    def layer_arch(self, layer: int) -> ModelArch:
        """The geometry of one layer, as `layer_kinds` gives it."""
        if not self.dense_layers:
            return self
        dense = len(self.dense_layers)
        if self.is_dense(layer):
            return self._dense_kind(dense)
        return dataclasses.replace(self, num_layers=self.num_layers - dense, dense_layers=())

    def _dense_kind(self, count: int) -> ModelArch:
        return dataclasses.replace(
            self,
            num_layers=count,
            dense_layers=tuple(range(count)),
            num_experts=1,
            experts_per_token=1,
            intermediate_size=self.dense_intermediate_size,
            shared_expert_intermediate_size=0,
            renormalize_top_k=False,
            router_norm_p=None,
            round_router_weights=False,
        )

    def check_positions(
        self,
        longest_prompt: int,
        gen_len: int,
        what: str = "a prompt",
        fix: str = "shorten the prompts or the generation length",
    ) -> None:
        """Refuse a prompt plus its new tokens beyond the positions the model was made for: the
        one count every command that takes lengths applies (rotary tables, the KV cache and the
        planner's context all assume it)."""
        limit = self.max_position_embeddings
        if limit is not None and longest_prompt + gen_len > limit:
            plus = f" plus {gen_len} new ones" if gen_len else ""
            raise HrmError(
                f"{what} of {longest_prompt} tokens{plus} needs {longest_prompt + gen_len} "
                f"positions, more than {self.name}'s {limit}; {fix}"
            )

    # -- parameter counts (per layer unless named otherwise) -----------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """What one head's attention returns per query: a head's V (latent attention: the latent,
        which the value up-projection then widens to v_head_dim)."""
        return self.kv_lora_rank or self.head_dim

    @property
    def attention_output_size(self) -> int:
        return self.num_attention_heads * self.value_dim

    @property
    def cached_value_dim(self) -> int:
        """A V row the cache stores (latent attention: none; its values are its key row's first
        kv_lora_rank columns)."""
        return 0 if self.kv_lora_rank else self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements of K and V one token stores in one layer."""
        return self.num_key_value_heads * (self.head_dim + self.cached_value_dim)

    def attention_linears(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """(in, out) of the GEMMs before attention (Q, K, V) and after it (O), as the executor
        runs them. Latent attention: q (through its low rank where it has one), the latent and
        rotary key, the key up-projection the queries absorb (nq of nope -> kv_lora, priced as
        one GEMM of as many weights and FLOPs); after: the value up-projection, then O."""
        h, nq = self.hidden_size, self.num_attention_heads
        if not self.kv_lora_rank:
            return ((h, self.q_size), (h, self.kv_size), (h, self.kv_size)), ((self.q_size, h),)
        q_out = nq * (self.qk_nope_head_dim + self.rotary_dim)
        r, c = self.q_lora_rank, self.kv_lora_rank
        q = ((h, r), (r, q_out)) if r else ((h, q_out),)
        absorb = (nq * self.qk_nope_head_dim, c)
        values = nq * self.v_head_dim
        return (*q, (h, self.head_dim), absorb), ((c, values), (values, h))

    @property
    def attention_params(self) -> int:
        """Q, K, V and O projections (+ biases and q/k norms where the family has them)."""
        if self.kv_lora_rank:  # + the RMSNorms of the latent and of q's low rank
            before, after = self.attention_linears()
            return sum(i * o for i, o in (*before, *after)) + self.kv_lora_rank + self.q_lora_rank
        h = self.hidden_size
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        params += h * self.output_bias  # (sinks, nq a layer, are the model's attention state)
        return params + self.qk_norm_params

    @property
    def qk_norm_params(self) -> int:
        if self.qk_norm == "head":
            return 2 * self.head_dim
        return self.q_size + self.kv_size if self.qk_norm == "projection" else 0

    @property
    def expert_params(self) -> int:
        """One expert: gate (w1), up (w3) and down (w2) projections (and their biases, gpt-oss)."""
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + (2 * i + h) * self.expert_bias

    @property
    def experts_params(self) -> int:
        return self.num_experts * self.expert_params

    @property
    def shared_expert_params(self) -> int:
        """The shared expert's three projections and its sigmoid gate [1, h]."""
        if not self.shared_expert_intermediate_size:
            return 0
        gate = self.hidden_size * self.shared_expert_gate
        return 3 * self.hidden_size * self.shared_expert_intermediate_size + gate

    @property
    def router_params(self) -> int:
        return 0 if self.ffn_is_dense else (self.hidden_size + self.router_bias) * self.num_experts

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden_size

    @property
    def dense_layer_params(self) -> int:
        """Everything in a layer except the routed experts: always needed, whichever tokens come."""
        return (
            self.attention_params
            + self.router_params
            + self.norm_params
            + self.shared_expert_params
        )

    @property
    def layer_params(self) -> int:
        """One layer's; a model with dense layers among sparse ones has no one figure: use
        `layers_params` or its `layer_kinds`."""
        if self.dense_layers and not self.ffn_is_dense:
            raise ValueError(f"{self.name}: layers of two kinds have no one layer_params")
        return self.dense_layer_params + self.experts_params

    @property
    def layers_params(self) -> int:
        """Every layer's parameters together."""
        return sum(kind.layer_params * n for kind, n in self.layer_kinds())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (
            self.layers_params
            + self.embedding_params
            + self.lm_head_params
            + self.hidden_size  # final norm
        )

    @property
    def active_params(self) -> int:
        """Parameters one token uses: its k experts instead of all of them."""
        return self.total_params - sum(
            n * (kind.num_experts - kind.experts_per_token) * kind.expert_params
            for kind, n in self.layer_kinds()
        )

    GEOMETRY = ("model_type", *COUNTS, "tie_word_embeddings")

    def geometry(self) -> dict[str, Any]:
        """What a plan depends on: two models with the same geometry take the same plans."""
        geometry = {name: getattr(self, name) for name in self.GEOMETRY}
        if self.dense_layers:  # named only where present, so that older plans still compare
            geometry |= {
                "dense_layers": list(self.dense_layers),
                "dense_intermediate_size": self.dense_intermediate_size,
            }
        if self.sliding_layers:
            geometry |= {
                "sliding_layers": list(self.sliding_layers),
                "sliding_window": self.sliding_window,
            }
        if self.kv_lora_rank:
            geometry |= {name: getattr(self, name) for name in LATENT_FIELDS}
        return geometry

    def weight_bytes(self, dtype: str) -> float:
        return self.total_params * dtype_bytes(dtype)

    def kv_token_bytes(self, dtype: str) -> float:
        """K and V of one token in one layer, in `dtype` (a compact format: its codes, scales
        and minima, hrm.formats.row_bytes)."""
        rows = (self.head_dim, self.cached_value_dim)
        if is_compact(dtype):
            return self.num_key_value_heads * sum(row_bytes(r, dtype) for r in rows if r)
        return self.kv_width * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str) -> float:
        """K and V of one token across all layers."""
        return self.num_layers * self.kv_token_bytes(dtype)

    # -- files ---------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls, config: Any, name: str = "model", where: str = "config.json"
    ) -> ModelArch:
        if not isinstance(config, Mapping):
            raise HrmError(f"{where}: expected a JSON object")
        model_type = config.get("model_type")
        parser = PARSERS.get(model_type)
        if parser is None:
            raise HrmError(
                f"{where}: unsupported model_type {model_type!r}; "
                f"supported: {', '.join(MODEL_TYPES)}"
            )
        try:
            fields = parser(config)
        except HrmError as exc:
            raise HrmError(f"{where}: {exc}") from None
        except KeyError as exc:
            raise HrmError(
                f"{where}: missing field {exc.args[0]!r} for model_type {model_type}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise HrmError(f"{where}: malformed field ({exc})") from None
        fields["eos_token_ids"] = eos_token_ids(config, where=where)
        try:
            return cls(name=name, model_type=model_type, **fields)
        except HrmError as exc:
            raise HrmError(f"{where}: {exc}") from None


def bundled_model_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def resolve_model(name_or_path: str | os.PathLike) -> ModelArch:
    """`--model NAME` (bundled), a config.json, a checkpoint directory or a GGUF file."""
    text = str(name_or_path)
    if text.endswith(".gguf"):  # its header alone
        from hrm.gguf_file import read_gguf

        return ModelArch.from_hf_config(*read_gguf(text).described())
    bundled = BUNDLED_DIR / f"{text}.json"
    if os.sep not in text and bundled.is_file():
        return ModelArch.from_hf_config(load_json(bundled), name=text, where=str(bundled))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise HrmError(f"{path.parent}: no config.json in this directory; is it a checkpoint?")
    elif not path.exists():
        known = ", ".join(bundled_model_names())
        raise HrmError(
            f"unknown model {text!r}: use one of {known}, a config.json, a checkpoint or a .gguf"
        )
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelArch.from_hf_config(load_json(path), name=name, where=str(path))
