"""The forward pass of Mixtral, DBRX, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, GLM-4.5 and
DeepSeek-V2/V3 (whose latent attention is executor/latent_attention.py), split into the paper's
three stages.

PreAttn (norm, QKV projection, rotary), Attn (KV append and attention) and PostAttn (O projection,
residual, norm, router, experts) are separate methods so that a schedule can interleave them
across micro-batches later (reference, section 3).  Token-wise stages work on packed tokens
[T, H]; only attention sees the padded [B, S] layout of the KV cache.  The numerics follow
transformers' modeling files so that outputs match token for token.

Legend: T = tokens in this step (packed), B = sequences, L = padded prompt length, S = cached
slots, H = hidden, V = vocabulary, nq / nkv = query / key-value heads, G = nq // nkv, D = head dim,
E = experts, K = experts per token, I = expert width, A = token-expert assignments (T*K).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter

import torch
import torch.nn.functional as F

from executor import fused_moe, small_ops
from executor.attention import append_and_attend, store_and_attend_prompts
from executor.checkpoint import Checkpoint, LayerWeights
from executor.fused_moe import fused_experts
from executor.kv_cache import KVCache
from executor.latent_attention import absorbed_layout, latent_queries_and_keys, latent_values
from executor.layer_math import NORMS, apply_rotary, inverse_frequencies, rms_norm, rotary_tables
from executor.packed_weights import packed_weights
from hrm.arch import GROUP_ROUTINGS
from hrm.errors import HrmError
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.rules.cpu_moe import GROUP_ROWS
from hrm.rules.gemm_paths import (
    WIDEN_SLICE_ELEMENTS,
    native_linear,
    pack_weight,
    packed_linear,
    widened_linear,
)
from hrm.rules.host_memory import keep_freed_host_memory

SORT_IN_PYTHON = 64  # a step's assignments at most that _assignments sorts as Python lists


class MoEModel:
    """Weights plus the per-stage math; holds no per-batch state (that lives in KVCache)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        cpu_gemm: CpuGemmChoice | None = None,
        *,
        device: torch.device | None = None,
        kv_format: str | None = None,
        reduce=None,
        gather=None,
        packs: bool = True,
        take_over: bool = False,
        cpu_moe: str = "loop",
    ):
        """kv_format: a compact format its KV caches store (hrm/formats.py; None: the model's
        dtype). device: where the layers run (default: where the checkpoint's weights are; a placed
        run loads them on the host and runs them on the GPU). cpu_gemm: the GEMM path per token
        count when that is a CPU (hrm.rules.cpu_gemm); without one a CPU model probes this host for
        it (about a second). A GPU runs every GEMM native. reduce: the sum over a
        tensor-parallel group of a rank's partial outputs, gather: its ranks' logits side by side
        (executor/tensor_parallel.py; None: one rank). packs: where the CPU GEMM path is packed,
        pack the weights held here once (executor/packed_weights.py); False where a store hands
        the layers over, whose pages then run native. take_over: the checkpoint's weights are
        released as they are packed (loaded for this model only; the caller must not read them
        again). cpu_moe: where a CPU model holds its weights, how the routed experts run: `loop`, an
        expert at a time, `fused`, each of their GEMMs one native call over every expert
        (executor/fused_moe.py; refused in one line where it cannot run), or `auto`, fused
        wherever it can run (hrm.rules.cpu_moe)."""
        keep_freed_host_memory()  # large temporaries reuse freed memory, not fresh pages
        self.arch = checkpoint.arch
        self.kv_format = kv_format
        self.weights = checkpoint.weights
        self.dtype = checkpoint.dtype
        self.device = checkpoint.weights.embed.device if device is None else torch.device(device)
        self._inv_freq, self._rope_scaling = inverse_frequencies(self.arch)
        # gpt-oss's sinks in fp32, per layer, and a copy on each other device that attends
        self._sinks = {
            i: w.sinks.to(torch.float32, copy=True)
            for i, w in enumerate(self.weights.layers)
            if w.sinks is not None
        }
        self._sinks_on: dict[tuple[int, torch.device], torch.Tensor] = {}
        dtype_name = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu":
            cpu_gemm = None
        elif cpu_gemm is None:
            from hrm.profiling.host_gemm import probe_cpu_gemm

            cpu_gemm = probe_cpu_gemm(self.arch, dtype_name, checkpoint.expert_gate_weights)
        elif cpu_gemm.dtype != dtype_name:
            raise HrmError(f"the CPU GEMM choice is for {cpu_gemm.dtype}, the run is {dtype_name}")
        held = packs and cpu_gemm is not None  # a CPU model laying out its own weights
        packed = held and "packed" in cpu_gemm.paths
        self.fused = fused_experts(self.arch, dtype_name, cpu_moe, held=held)
        kernel = self.fused and fused_moe.fused_linears(cpu_gemm)  # the other matrices too
        # a bf16 run's kernel: the small ops between the GEMMs too, and on AMX decode attention
        self._rms, self._rotary = (small_ops.rms_norm, small_ops.rotary) if self.fused else (
            rms_norm, apply_rotary)  # fmt: skip
        self._native_attention = self.fused and small_ops.amx_attention()
        native = {"rmsnorm": self._rms, "rmsnorm_fp32": small_ops.rms_norm_fp32}
        self._norm = (native if self.fused else {}).get(self.arch.norm, NORMS[self.arch.norm])
        if cpu_gemm is not None:  # what the record reports and a prediction prices
            cpu_gemm = self._as_run(cpu_gemm, kernel)
        self.cpu_gemm = cpu_gemm
        if packed or self.fused:
            # the other matrices: for the kernel, for oneDNN where packed, else as they are
            linears = fused_moe.linear_packing(packed) if kernel else (pack_weight if packed
                                                                       else None)  # fmt: skip
            self.weights = packed_weights(
                self.weights, router_linear=self.arch.routing not in GROUP_ROUTINGS,
                take_over=take_over, fused=fused_moe.pack if self.fused else None, linears=linears,
            )  # fmt: skip
        if held:  # DeepSeek's up-projection laid out once as the absorbed form reads it
            self.weights = absorbed_layout(self.arch, self.weights)
        self.reduce = reduce if reduce is not None else (lambda t: t)
        self.gather = gather if gather is not None else (lambda t: t)
        self.gemm_calls: Counter[str] = Counter()  # GEMMs run per path: what the record reports
        # weights stay stored in the run's dtype; one scratch buffer, reused, holds a widened slice
        widens = cpu_gemm is not None and "widened" in cpu_gemm.paths
        self._scratch = torch.empty(WIDEN_SLICE_ELEMENTS) if widens else None

    def _as_run(self, cpu_gemm: CpuGemmChoice, kernel: bool) -> CpuGemmChoice:
        """cpu_gemm with how this model runs its experts, its other matrices and their GLU."""
        return dataclasses.replace(cpu_gemm, experts="fused" if self.fused else "loop",
                                   linears="fused" if kernel else "paths",
                                   glu="tiles" if self._glu_tiles else "apart")  # fmt: skip

    @functools.cached_property
    def _glu_tiles(self) -> bool:
        """Whether the fused gate-up call computes the SwiGLU in its tiles (grouped_swiglu)."""
        return self.fused and fused_moe.glu_in_tiles(self.arch)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ w [out, in].T along the chosen path for T tokens; the result in x's dtype."""
        if self.cpu_gemm is None:
            self.gemm_calls["native"] += 1
            return native_linear(x, w)
        if isinstance(w, fused_moe.Kernel):  # laid out for the kernel (fused_linears)
            self.gemm_calls["fused"] += 1
            return w.times(x)
        tokens = x.shape[0]
        path = self.cpu_gemm.path_at(tokens)
        if path == "packed" and not w.is_mkldnn:
            path = "native"  # a page a store handed over: not packed
        self.gemm_calls[path] += 1
        rows = int(self.cpu_gemm.rows_at(tokens, (w.shape[1], w.shape[0])))
        if path == "widened":
            return widened_linear(x, w, self._scratch, rows=rows)
        if path == "packed":
            return packed_linear(x, w, rows=rows)
        return native_linear(x, w, rows=rows)

    def time_stages(self, stages: dict[str, str], seconds: dict, key=None) -> None:
        """Wrap each of this model's methods in `stages` (method name -> part) so that its wall
        time adds to seconds[key(part)] (default: the part): the one timing hook the profilers
        and the by-operation bench read the model's stages with."""
        for name, part in stages.items():
            inner = getattr(self, name)

            def timed(*args, _inner=inner, _part=part, **kwargs):
                t0 = time.perf_counter()
                out = _inner(*args, **kwargs)
                at = key(_part) if key is not None else _part
                seconds[at] = seconds.get(at, 0.0) + time.perf_counter() - t0
                return out

            setattr(self, name, timed)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | None = None,
        layer_devices: list[torch.device] | None = None,
        slot_major: frozenset[int] = frozenset(),
        windowed: bool = True,
    ) -> KVCache:
        """A cache of every layer on `device` (default the model's), or of one layer per entry
        of layer_devices, each where it says (slot_major, windowed: executor/kv_cache.py)."""
        return KVCache.for_model(
            self.arch,
            batch_size=batch_size,
            max_len=max_len,
            dtype=self.dtype,
            device=device or self.device,
            layer_devices=layer_devices,
            slot_major=slot_major,
            kv_format=self.kv_format,
            windowed=windowed,
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weights.embed[token_ids]  # [T, H]

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(positions, self._inv_freq, self.dtype, self._rope_scaling)

    def attention_terms(self, layer: int, device: torch.device, *, decode: bool = False) -> dict:
        """What a layer's attention adds to causal attention: its window, sinks (on `device`) and
        the scores' scale where the family sets its own; a decode step's kernel: the native one
        where a fused bf16 model's step runs on an AMX host's CPU (attention.native_decode). The
        loop keeps SDPA, transformers' own kernel: a tiny Qwen3-MoE's bf16 loop run with the
        native one flipped an expert at step 6 against transformers (11% of the logits)."""
        terms: dict = {"window": self.arch.window(layer), "scale": self.arch.softmax_scale}
        if decode and self._native_attention and torch.device(device).type == "cpu":
            terms["kernel"] = "native"
        if layer in self._sinks:
            key = (layer, torch.device(device))
            if key not in self._sinks_on:
                self._sinks_on[key] = self._sinks[layer].to(device)
            terms["sinks"] = self._sinks_on[key]
        return terms

    # -- PreAttn -------------------------------------------------------------------------------

    def pre_attention(self, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, QKV projection (+ bias), q/k norm, clip, rotary: h [T, H] -> q [T, nq, D], k and
        v [T, nkv, D]. OLMoE normalises the whole projection before its clip, Qwen3-MoE each
        head after the reshape; both before rotary, as transformers does. Latent attention:
        executor/latent_attention.py."""
        a = self.arch
        x = self._norm(h, w.attn_norm, a.norm_eps)  # [T, H]
        if a.kv_lora_rank:
            return latent_queries_and_keys(self, w, x, cos, sin)
        q = self.linear(x, w.wq)  # [T, nq*D]
        k, v = self.linear(x, w.wk), self.linear(x, w.wv)  # [T, nkv*D]
        if w.bq is not None:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        if a.qk_norm == "projection":
            q, k = self._rms(q, w.q_norm, a.norm_eps), self._rms(k, w.k_norm, a.norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp_(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        T, D = h.shape[0], a.head_dim
        q, k = q.view(T, -1, D), k.view(T, -1, D)
        if a.qk_norm == "head":
            q, k = self._rms(q, w.q_norm, a.norm_eps), self._rms(k, w.k_norm, a.norm_eps)
        return self._rotary(q, cos, sin), self._rotary(k, cos, sin), v.view(T, -1, D)

    # -- Attn ----------------------------------------------------------------------------------

    def prefill_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch_idx: torch.Tensor,
        slot_idx: torch.Tensor,
        cache_layer: int | None = None,
    ) -> torch.Tensor:
        """Store the prompts' K/V and attend causally: packed q [T, nq, D] -> [T, nq*D] (the
        stage `hrm profile` times for the prefill attention curve); `layer`'s K/V go to the
        cache's `cache_layer` (default: `layer`; a transient one-layer cache's 0)."""
        at = layer if cache_layer is None else cache_layer
        terms = self.attention_terms(layer, q.device)
        return store_and_attend_prompts(cache, at, q, k, v, batch_idx, slot_idx, **terms)

    def decode_attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Append one token per sequence, attend to every cached slot: [B, nq, D] -> [B, nq*D]
        (the stage `hrm profile` times for the attention curve)."""
        terms = self.attention_terms(layer, q.device, decode=True)
        return append_and_attend(cache, layer, q, k, v, **terms)

    # -- PostAttn ------------------------------------------------------------------------------

    def post_attention(self, w: LayerWeights, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """O projection, residual, norm, router, experts and the shared expert where the family
        has one: [T, nq*Dv], [T, H] -> [T, H] (latent attention: the value up-projection first)."""
        if self.arch.kv_lora_rank:
            attn = latent_values(self.arch, w, attn)
        o = self.reduce(self.linear(attn, w.wo))  # a tensor-parallel rank's heads: a part
        h = h + (o if w.bo is None else o + w.bo)  # [T, H]
        x = self._norm(h, w.ffn_norm, self.arch.norm_eps)  # [T, H]
        out = self.experts(w, x)
        if w.shared_w1 is not None:  # routed + shared (Qwen2-MoE: sigmoid(gate) * shared)
            shared = self.linear(
                F.silu(self.linear(x, w.shared_w1)) * self.linear(x, w.shared_w3), w.shared_w2
            )
            if w.shared_gate is not None:
                shared = torch.sigmoid(self.linear(x, w.shared_gate)) * shared
            out = out + shared
        return h + self.reduce(out)

    def route(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router softmax in fp32, top-k, and each family's normalisation: [T, K] weights (fp32,
        or the model's dtype where the family rounds them), ids. A dense layer routes every
        token to expert 0 with weight 1 in fp32, so that its MLP's output is left as it is."""
        a = self.arch
        if w.router is None:  # a dense layer: every token to its MLP, the one expert, weight 1
            ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            return ones, torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        if a.routing in GROUP_ROUTINGS:
            return self._route_in_groups(w, x)
        logits = self.linear(x, w.router)  # [T, E]
        if w.router_bias is not None:
            logits = logits + w.router_bias
        if a.routing == "topk_softmax":  # gpt-oss: in the model's dtype, as transformers does
            top_l, top_i = torch.topk(logits, a.experts_per_token, dim=-1)
            return torch.softmax(top_l, dim=-1), top_i
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        top_w, top_i = torch.topk(probs, a.experts_per_token, dim=-1)  # [T, K]
        if a.renormalize_top_k:  # Mixtral
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        elif a.router_norm_p is not None:  # DBRX
            top_w = top_w / torch.linalg.vector_norm(
                top_w, ord=a.router_norm_p, dim=-1, keepdim=True
            )
        if a.round_router_weights:  # Qwen, OLMoE: the experts are scaled in the model's dtype
            top_w = top_w.to(x.dtype)
        return top_w, top_i

    def _route_in_groups(self, w: LayerWeights, x: torch.Tensor):
        """DeepSeek's and GLM-4.5's routers, in fp32 as transformers runs them. V3 and GLM:
        sigmoid scores, the bias moving the choice, not the weights, each group ranked by its two
        best scores; V2: softmax scores, each group ranked by its best. The top k taken from the
        best topk_group groups; weights renormalised (norm_topk_prob) and scaled by
        routed_scaling_factor."""
        a, T = self.arch, x.shape[0]
        logits = F.linear(x.float(), w.router.float())  # [T, E]
        sigmoid = a.routing == "sigmoid_groups"
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        choice = scores if w.router_bias is None else scores + w.router_bias.float()
        if a.n_group > 1:
            grouped = choice.view(T, a.n_group, -1)  # [T, groups, E / groups]
            ranked_by = min(2, grouped.shape[-1]) if sigmoid else 1
            best = grouped.topk(ranked_by, dim=-1).values.sum(-1)
            kept = torch.topk(best, a.topk_group, dim=-1, sorted=False).indices
            mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], 1), -torch.inf)
        top_i = torch.topk(choice, a.experts_per_token, dim=-1, sorted=False).indices
        top_w = scores.gather(1, top_i)
        if a.renormalize_top_k:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * a.routed_scaling_factor, top_i

    def experts(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """MoE FFN grouped by expert: sort assignments by expert, one GEMM chain per expert hit,
        or each GEMM one call over all of them where fused (a dense layer: its MLP, the one
        expert every token takes, by the loop)."""
        top_w, top_i = self.route(w, x)  # [T, K]
        T, K = top_i.shape
        # transformers scales each expert's output by its fp32 weight, rounds to the model dtype
        # and adds the experts to zeros in index order. index_add_ would add in index order on a
        # CPU, but on CUDA it adds with atomics in any order (top-k >= 3 rounds differently run
        # to run), so each token's K outputs are put in expert order and added in turn (source).
        if self.fused and w.router is not None:  # every expert's GEMMs in one call each
            xs, scale, source, counts = small_ops.dispatch(x, top_w, top_i, len(w.experts))
            ys = self._fused_experts(w, xs, counts)
            del xs
            return small_ops.combine(ys, scale, source, K)  # scaled, rounded, added: one pass
        order, counts, source = _assignments(top_i, len(w.experts))  # sorted by expert: [A]
        # index_select, not x[...]: the same rows, 5x faster at 512 x 1024 bf16 (AMX Xeon)
        xs = x.index_select(0, order // K)  # [A, H]
        scale = top_w.flatten().index_select(0, order)[:, None]  # [A, 1] fp32
        ys = torch.empty_like(xs)  # [A, H]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                ys[rows] = self.expert(w.experts[e], xs[rows]) * scale[rows]  # [n, H]
                start += n
        del xs
        by_token = ys.index_select(0, source).view(T, K, -1)  # [T, K, H], experts in index order
        out = by_token[:, 0]
        for k in range(1, K):
            out = out + by_token[:, k]
        return out  # [T, H]

    def _fused_experts(self, w: LayerWeights, xs: torch.Tensor, counts: list[int]):
        """The routed experts' MLP over xs [A, H] sorted by expert, as `expert` computes it,
        each of its two GEMMs one grouped call over a run of consecutive experts of at most
        GROUP_ROWS rows, or one expert of more: a prefill's transient is then the loop's (one
        expert's rows at a time), a decode's one call a GEMM (hrm.rules.cpu_moe)."""
        groups, first, rows = [], 0, 0
        for e, n in enumerate(counts):
            if rows and rows + n > GROUP_ROWS:
                groups.append((first, e))
                first, rows = e, 0
            rows += n
        groups.append((first, len(counts)))
        if len(groups) == 1:
            return self._fused_group(w, xs, counts, 0)
        ys, start = torch.empty_like(xs), 0
        for a, b in groups:
            end = start + sum(counts[a:b])
            ys[start:end] = self._fused_group(w, xs[start:end], counts[a:b], a)
            start = end
        return ys

    def _fused_group(self, w: LayerWeights, xs: torch.Tensor, counts: list[int], first: int):
        """_fused_experts over experts first.. (counts[j] rows each): SwiGLU in place on the
        gate's half, so that a row holds 3 I beside its input (the loop's count); a family's
        biases (gpt-oss) added to each row by its expert's, in the model's dtype as the loop
        adds them, and its clamped GLU."""
        self.gemm_calls["fused"] += 2
        i, h = self.arch.intermediate_size, self.arch.hidden_size
        # the experts hit only: a batch-1 step of 64 experts passed 8, not 128 weights, each
        # converted for the call (50 us a call of 8 at Qwen3-MoE's shape, AMX Xeon)
        hit = [j for j, n in enumerate(counts) if n]
        experts = [w.experts[first + j] for j in hit]
        counts = [counts[j] for j in hit]
        biased = experts[0].b1 is not None
        rows = torch.tensor(counts) if biased else None

        def bias(name: str) -> torch.Tensor:  # [A, width]: each row its expert's
            return torch.stack([getattr(e, name) for e in experts]).repeat_interleave(rows, 0)

        gate_up = [t for e in experts for t in (e.w1, e.w3) if t is not None]  # parts
        if self._glu_tiles:
            hidden = fused_moe.grouped_swiglu(xs, counts, gate_up, 2 * i)  # the tiles' SwiGLU
            return fused_moe.grouped(hidden, counts, [e.w2 for e in experts], h)
        gate, up = fused_moe.grouped(xs, counts, gate_up, 2 * i).chunk(2, -1)
        if biased:
            gate, up = gate + bias("b1"), up + bias("b3")
        if self.arch.swiglu_limit is None:
            hidden = F.silu(gate, inplace=True).mul_(up)  # the loop's values, in place
        else:
            hidden = self._glu(gate, up)
        out = fused_moe.grouped(hidden, counts, [e.w2 for e in experts], h)
        return out + bias("b2") if biased else out

    def expert(self, ex, x: torch.Tensor) -> torch.Tensor:
        """One expert's MLP on its rows: SwiGLU, or gpt-oss's clamped GLU with biases."""
        if ex.w3 is None:  # gate and up stacked in one packed weight
            gate, up = self.linear(x, ex.w1).chunk(2, dim=-1)
        else:
            gate, up = self.linear(x, ex.w1), self.linear(x, ex.w3)
        if ex.b1 is not None:
            gate, up = gate + ex.b1, up + ex.b3
        out = self.linear(self._glu(gate, up), ex.w2)
        return out if ex.b2 is None else out + ex.b2

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU, or gpt-oss's clamped GLU."""
        limit = self.arch.swiglu_limit
        if limit is None:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.arch.swiglu_alpha))

    # -- output --------------------------------------------------------------------------------

    def logits(self, h: torch.Tensor, final_norm=None, lm_head=None) -> torch.Tensor:
        """Final norm and LM head on the positions that sample: [B, H] -> [B, V] in the head's
        dtype (with the device's own copies of the two weights when given). Samplers widen what
        they need: a greedy step reads the bf16 rows once (generate.greedy), where widening a
        batch-64 step's [64, 32000] to fp32 took 1.1 ms of a 49 ms step (AMX Xeon)."""
        final_norm = self.weights.final_norm if final_norm is None else final_norm
        lm_head = self.weights.lm_head if lm_head is None else lm_head
        x = self._norm(h, final_norm, self.arch.norm_eps)
        return self.gather(self.linear(x, lm_head))  # tensor parallel: a vocabulary share


def _assignments(top_i: torch.Tensor, experts: int):
    """A step's assignments (top_i [T, K]) sorted by expert, stably: their order [A], the rows
    each expert takes (a list of `experts`) and _by_token's source [A]; a few sequences' ids
    sorted in Python, where torch's 11 small ops took 0.1 ms a layer at one (AMX Xeon)."""
    T, K = top_i.shape
    if T * K > SORT_IN_PYTHON:
        order = torch.argsort(top_i.flatten(), stable=True)
        counts = torch.bincount(top_i.flatten(), minlength=experts).tolist()
        return order, counts, _by_token(top_i, order)
    ids = top_i.flatten().tolist()
    order = sorted(range(len(ids)), key=ids.__getitem__)  # stable, as argsort's
    counts = [0] * experts
    rank = [0] * len(ids)  # each assignment's place among its token's experts, by index
    for t in range(T):
        for r, a in enumerate(sorted(range(t * K, (t + 1) * K), key=ids.__getitem__)):
            rank[a] = r
    source = [0] * len(ids)
    for i, a in enumerate(order):
        counts[ids[a]] += 1
        source[(a // K) * K + rank[a]] = i
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=top_i.device)
    return as_tensor(order), counts, as_tensor(source)


def _by_token(top_i: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[T * K]: the row of the expert-sorted assignments (`order`) at each token's k-th place,
    its experts in index order."""
    K = top_i.shape[1]
    rank = top_i.argsort(dim=-1).argsort(dim=-1).flatten()  # [A] place among the token's
    place = (order // K) * K + rank[order]  # [A] each sorted row's place by token
    rows = torch.arange(len(place), device=place.device)
    return torch.empty_like(place).scatter_(0, place, rows)  # the sorted row at each place
