"""A GGUF file's tensors under the Hugging Face names executor/checkpoint.py reads, so that every
family's reader serves GGUF as it serves safetensors (checkpoint_files.Tensors takes this in
place of a SafetensorsFile).

F32, F16 and BF16 tensors are views of the mapped file. Quantized ones (Q8_0, Q4_K ...) are
dequantized by the `gguf` package, once per tensor, into the run's dtype; the experts of a layer
are one GGUF tensor [E, out, in], and each expert is a view of it. Where llama.cpp's converter
changed a tensor, it is changed back here: Mixtral's q and k rows (permuted for llama.cpp's
rotary), DeepSeek's kv_b_proj (split into attn_k_b, transposed, and attn_v_b), gpt-oss's
experts (gate and up split apart, transformers keeps them interleaved).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.gguf_file import RUN_TYPES, GgufModel, GgufTensor

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Hugging Face name under model.layers.{i}. -> GGUF name under blk.{i}. (biases alike)
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
_EXPERTS = {  # model_type -> (router, experts' prefix, names of gate, up, down)
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "gpt_oss": ("mlp.router", None, None),
}
_QWEN_EXPERTS = ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
_GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class GgufShard:
    """The duck type of executor/safetensors_mmap.SafetensorsFile that Tensors reads."""

    def __init__(self, model: GgufModel, arch: ModelArch, dtype: torch.dtype):
        self.path, self._model, self._arch, self._dtype = model.path, model, arch, dtype
        self._maps: dict[Path, mmap.mmap] = {}
        self._bases: dict[str, torch.Tensor] = {}  # GGUF name -> its tensor, decoded once
        self._names: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}
        for name, t in model.tensors.items():
            if t.kind not in RUN_TYPES:
                raise HrmError(
                    f"{model.path}: tensor {name} is {t.kind}, which hrm cannot decode; "
                    f"supported types: {', '.join(RUN_TYPES)}"
                )
        self._name_globals()
        for i in range(arch.num_layers):
            self._name_layer(i)

    # -- SafetensorsFile's interface -----------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._names[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.tensor(name).dtype

    def tensor(self, name: str) -> torch.Tensor:
        return self._names[name][1]()

    def populate(self, name: str) -> None:
        """Views of the file are read in when touched: Tensors copies or keeps them."""

    def release(self, name: str) -> None:
        """Decoded tensors are freed when the last expert view of them goes."""

    # -- GGUF tensors --------------------------------------------------------------------------

    def _base(self, gguf_name: str) -> torch.Tensor:
        """A GGUF tensor in torch's order: a view of the file when it is stored as a float,
        else dequantized into the run's dtype (kept for the other experts' views)."""
        if gguf_name in self._bases:
            return self._bases[gguf_name]
        t = self._model.tensors[gguf_name]
        raw = self._bytes(t)
        if t.kind in _FLOATS:
            out = raw.view(_FLOATS[t.kind]).view(t.shape)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            rows = raw.numpy().reshape(*t.shape[:-1], -1)
            values = dequantize(rows, GGMLQuantizationType[t.kind])
            out = torch.from_numpy(np.ascontiguousarray(values)).to(self._dtype).view(t.shape)
        self._bases[gguf_name] = out
        return out

    def _bytes(self, t: GgufTensor) -> torch.Tensor:
        if t.path not in self._maps:
            with open(t.path, "rb") as f:  # private: writable views, the file never written
                self._maps[t.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return torch.frombuffer(self._maps[t.path], dtype=torch.uint8, count=t.nbytes,
                                offset=t.offset)  # fmt: skip

    def _add(self, hf_name: str, gguf_name: str, change=None) -> None:
        """hf_name reads gguf_name (through `change`), where the file holds it."""
        t = self._model.tensors.get(gguf_name)
        if t is None:
            return
        shape = t.shape
        if change is not None:
            shape = tuple(change(torch.empty(t.shape, device="meta")).shape)
        read = (lambda: self._base(gguf_name)) if change is None else (
            lambda: change(self._base(gguf_name)))  # fmt: skip
        self._names[hf_name] = (shape, read)

    def _name_globals(self) -> None:
        self._add("model.embed_tokens.weight", "token_embd.weight")
        self._add("model.norm.weight", "output_norm.weight")
        self._add("lm_head.weight", "output.weight")

    def _name_layer(self, i: int) -> None:
        p, b, arch = f"model.layers.{i}.", f"blk.{i}.", self._arch
        unpermute = {}
        if arch.model_type == "mixtral":  # llama.cpp's LlamaModel.permute, undone
            unpermute = {"attn_q": arch.num_attention_heads, "attn_k": arch.num_key_value_heads}
        for hf, gg in _LAYER.items():
            for kind in ("weight", "bias"):
                heads = unpermute.get(gg)
                change = None if heads is None else (lambda w, n=heads: _unpermute(w, n))
                self._add(f"{p}{hf}.{kind}", f"{b}{gg}.{kind}", change)
        norm = "ffn_norm" if b + "ffn_norm.weight" in self._model.tensors else "post_attention_norm"
        self._add(p + "post_attention_layernorm.weight", f"{b}{norm}.weight")
        self._add(p + "self_attn.sinks", b + "attn_sinks.weight")
        if b + "attn_k_b.weight" in self._model.tensors:
            self._latent_up(p, b)
        router, prefix, names = _EXPERTS.get(arch.model_type, _QWEN_EXPERTS)
        self._add(f"{p}{router}.weight", b + "ffn_gate_inp.weight")
        self._add(f"{p}{router}.bias", b + "ffn_gate_inp.bias")
        self._add(p + "mlp.gate.e_score_correction_bias", b + "exp_probs_b.bias")
        if arch.model_type == "gpt_oss":
            self._gpt_oss_experts(p, b)
            return
        for hf, gg in zip(names, _GGUF_EXPERTS, strict=True):
            t = self._model.tensors.get(f"{b}{gg}.weight")
            for e in range(t.shape[0] if t is not None else 0):
                self._add(f"{p}{prefix}.{e}.{hf}.weight", f"{b}{gg}.weight", lambda w, e=e: w[e])

    def _latent_up(self, p: str, b: str) -> None:
        """kv_b_proj [nq * (nope + v), latent], which llama.cpp splits into attn_k_b [nq,
        latent, nope] (each head's key part, transposed) and attn_v_b [nq, v, latent]."""
        k_b, v_b = (self._model.tensors[f"{b}attn_{x}_b.weight"] for x in "kv")
        heads, latent, nope = k_b.shape
        rows = heads * (nope + v_b.shape[1])

        def read() -> torch.Tensor:
            k = self._base(k_b.name).transpose(1, 2)
            return torch.cat((k, self._base(v_b.name)), dim=1).reshape(rows, latent)

        self._names[p + "self_attn.kv_b_proj.weight"] = ((rows, latent), read)

    def _gpt_oss_experts(self, p: str, b: str) -> None:
        """transformers' gpt-oss layout: gate_up_proj [E, H, 2I] with gate and up interleaved
        (llama.cpp splits them into ffn_gate_exps and ffn_up_exps [E, I, H]), down_proj
        [E, I, H] (the transpose of ffn_down_exps), biases [E, 2I] interleaved and [E, H]."""
        x, t = p + "mlp.experts.", self._model.tensors
        for kind, key, joined in (("weight", "gate_up_proj", True),
                                  ("bias", "gate_up_proj_bias", False)):  # fmt: skip
            gate, up = t.get(f"{b}ffn_gate_exps.{kind}"), t.get(f"{b}ffn_up_exps.{kind}")
            if gate is None or up is None:
                continue

            def read(g=gate.name, u=up.name, joined=joined) -> torch.Tensor:
                both = torch.stack((self._base(g), self._base(u)), dim=2)  # [E, I, 2, (H)]
                both = both.flatten(1, 2)  # [E, 2I, (H)], gate and up interleaved
                return both.transpose(1, 2).contiguous() if joined else both

            shape = (*gate.shape[:1], *reversed(gate.shape[1:])) if joined else gate.shape
            shape = (shape[0], shape[1], 2 * shape[2]) if joined else (shape[0], 2 * shape[1])
            self._names[x + key] = (shape, read)
        self._add(x + "down_proj", b + "ffn_down_exps.weight", lambda w: w.transpose(1, 2))
        self._add(x + "down_proj_bias", b + "ffn_down_exps.bias")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: each head's rows from (pair, half) order
    back to (half, pair)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )
