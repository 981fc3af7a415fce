"""Seconds one micro-batch spends in one layer at every step, on each device and link: the
per-micro-batch inputs of the cost model (planner/cost.py attaches the placement to them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hrm.formats import is_compact
from hrm.hardware.parts import DeviceSpec
from hrm.policy import dtype_bytes
from hrm.roofline.ops import ACTIVATION_DTYPE, layer_ops, lm_head_op, prefill_attention_flops
from hrm.rules.cpu_gemm import CpuGemmChoice
from planner.memory import PREFILL_CHUNK_TOKENS
from planner.op_time import expert_ffn_seconds, linears_choice, op_seconds, runs_fused
from planner.overheads import launch_seconds, step_seconds, unhidden_gpu_launch
from planner.setting import Setting
from planner.transfers import all_reduce_seconds, link_seconds

DENSE_OPS = ("norms", "qkv_proj", "o_proj", "router", "shared_expert")


@dataclass(frozen=True, kw_only=True)
class MicroBatchSeconds:
    """Seconds one micro-batch of b sequences spends per layer at every step, on each resource."""

    gpu_dense: np.ndarray
    gpu_ffn: np.ndarray
    gpu_attention: np.ndarray
    cpu_dense: np.ndarray
    cpu_ffn: np.ndarray
    cpu_attention: np.ndarray
    activations_to_gpu: np.ndarray  # prefill: hidden page in; decode: attention output (D2)
    activations_to_cpu: np.ndarray  # prefill: hidden page out; decode: QKV (D1)
    # the CPU part of the cache, prefetched: decode with GPU attention, a later prompt chunk's
    # earlier tokens
    kv_to_gpu: np.ndarray
    kv_to_cpu: np.ndarray  # prefill: the prompt's K, V; decode: the new token's
    gpu_all_reduce: np.ndarray  # tensor parallelism: after attention and after the experts
    cpu_launch: np.ndarray  # the executor's fixed cost of one layer on the CPU (measured)
    gpu_launch: np.ndarray  # the host's issue time of a GPU layer its kernels do not cover
    head_gpu: np.ndarray  # final norm + LM head, once per step (not per layer)
    head_cpu: np.ndarray
    embed_to_gpu: np.ndarray  # next tokens' embeddings, gathered on the CPU


# the share of a micro-batch a decode step computes, rounded up to this many parts (at most this
# many distinct evaluations per micro-batch size)
ACTIVE_PARTS = 64


def micro_batch_seconds(setting: Setting, b: float) -> MicroBatchSeconds:
    """Per-layer seconds of one micro-batch of b sequences at each step, on either device: of the
    mean layer where dense layers sit among sparse ones (docs/decisions.md, 2026-12-05). Where
    the requests have lengths of their own, decode step t computes the sequences still going,
    b * active_t of them in expectation (Workload.decode_active, rounded up to 1/ACTIVE_PARTS):
    one evaluation with a size per step. Kept by b in the setting's layer_memo (a search asks
    for the same b at many points)."""
    if b not in setting.layer_memo:
        active = np.ceil(setting.workload.decode_active * ACTIVE_PARTS - 1e-9) / ACTIVE_PARTS
        sizes = b if (active >= 1).all() else b * np.concatenate([[1.0], active])
        setting.layer_memo[b] = _mean_layer(setting, sizes)
    return setting.layer_memo[b]


def _mean_layer(setting: Setting, b) -> MicroBatchSeconds:
    """`b`: the micro-batch's sequences, or one entry per step (step 0 the prefill)."""
    kinds = [(_kind_seconds(kind, b), share) for kind, share in setting.kinds()]
    if len(kinds) == 1:
        return kinds[0][0]
    return MicroBatchSeconds(
        **{
            f.name: sum(getattr(mb, f.name) * share for mb, share in kinds)
            for f in dataclasses.fields(MicroBatchSeconds)
        }
    )


def _sizes(b) -> tuple[float, object]:
    """(prefill's sequences, decode's: one number, or one per decode step)."""
    return (b, b) if np.ndim(b) == 0 else (float(b[0]), b[1:])


def _phase_ops(setting: Setting, b) -> tuple[dict, dict]:
    """The layer's ops by name in prefill (its chunks' FFN groups) and in decode."""
    b_pre, b_dec = _sizes(b)

    def ops(batch, new_tokens, context, group) -> dict:
        out = {
            op.name: op
            for op in layer_ops(
                setting.arch,
                batch=batch,
                new_tokens=new_tokens,
                context=context,
                weight_dtype=setting.compute_dtype,  # a compact format's, dequantized
                kv_dtype=setting.kv_dtype,
                ffn_group_tokens=group,
            )  # fmt: skip
        }
        if is_compact(setting.kv_dtype):  # read through a 16-bit copy, written then read
            att = out["attention"]
            keys = setting.arch.mean_keys(context) if new_tokens == 1 else context
            copy = 2.0 * batch * keys * setting.arch.kv_width * dtype_bytes(ACTIVATION_DTYPE)
            out["attention"] = dataclasses.replace(
                att, activation_bytes=att.activation_bytes + copy
            )
        return out

    s_pre = setting.workload.prefill_len
    chunk = min(b_pre * s_pre, PREFILL_CHUNK_TOKENS)
    prefill = ops(b_pre, s_pre, s_pre + setting.prefill_prefix, chunk)
    return prefill, ops(b_dec, 1, setting.decode_contexts, b_dec)


def _on_device(
    setting: Setting,
    b: float,
    phases: tuple[dict, dict],
    role: str,
    device: DeviceSpec | None,
    cpu_gemm: CpuGemmChoice | None = None,
) -> dict[str, np.ndarray]:
    """A micro-batch's dense ops, routed FFN, attention and LM head on one device, per step;
    `phases`: the layer's ops in prefill and decode (_phase_ops)."""
    steps, dtype, wl = setting.steps, setting.compute_dtype, setting.workload
    if device is None:  # no GPU: these entries are multiplied by F_g = 0
        return {key: np.zeros(steps) for key in ("dense", "ffn", "attention", "head")}
    arch, (prefill, decode) = setting.arch, phases
    s_pre, (b_pre, b_dec) = wl.prefill_len, _sizes(b)
    chunk = min(b_pre * s_pre, PREFILL_CHUNK_TOKENS)
    linears = linears_choice(device, dtype, cpu_gemm)  # the dense ops' and the LM head's

    def both(name: str, pre_rows: float, dec_rows: float, gemm=linears) -> np.ndarray:
        if name not in prefill:
            return np.zeros(steps)
        pre = op_seconds(prefill[name], device, dtype, pre_rows, cpu_gemm=gemm)
        dec = op_seconds(decode[name], device, dtype, dec_rows, cpu_gemm=gemm)
        return np.concatenate([[pre], dec * np.ones(steps - 1)])

    def ffn(tokens: float, group: float) -> float:
        memo = setting.ffn_memo.setdefault(role, {})
        return expert_ffn_seconds(arch, device, dtype, tokens=tokens, group_tokens=group,
                                  weight_dtype=dtype, cpu_gemm=cpu_gemm,
                                  memo=memo)  # fmt: skip

    def decode_ffn() -> np.ndarray:  # each step's micro-batch, one group of its b
        sizes, where = np.unique(np.asarray(b_dec, dtype=float), return_inverse=True)
        each = np.array([ffn(float(x), float(x)) for x in sizes.flat])
        return each[where].reshape(np.shape(b_dec)) * np.ones(steps - 1)

    head = lm_head_op(arch, batch=b, weight_dtype=dtype)  # b: at each step
    attention = both("attention", s_pre, arch.num_attention_heads / arch.num_key_value_heads,
                     cpu_gemm)  # fmt: skip
    on_cpu = cpu_gemm is not None
    prefill_curve = device.prefill_attention_curves.get(setting.kv_dtype) if on_cpu else None
    if prefill_curve is not None:
        # prefill attention on the CPU at the executor's measured rate for the FLOPs it
        # computes, the micro-batch padded to the longest prompt (hrm profile):
        # T = F_exec / R(F_exec)
        flops = prefill_attention_flops(
            arch,
            batch=b_pre,
            length=wl.prompt_len_max,
            keys=wl.prompt_len_max + setting.prefill_prefix,
        )
        attention[0] = flops / prefill_curve.at(flops)
    latent = device.latent_attention_curves if arch.kv_lora_rank else {}
    curve = latent.get(setting.kv_dtype) or device.attention_curves.get(setting.kv_dtype)
    if on_cpu and curve is not None and steps > 1:
        # decode attention on the CPU at the executor's measured K/V read rate in the KV
        # dtype for this many bytes per call (hrm profile), latent attention's own where
        # measured (its heads share one row, read by batched GEMMs): T = bytes / B_attn(bytes)
        kv = np.asarray(decode["attention"].bytes, dtype=float) * np.ones(steps - 1)
        attention[1:] = kv / curve.at_each(kv)
    if setting.paged_kv_cache:  # the rows gathered from the pool: read once, written once
        decode_rows = np.asarray(decode["attention"].kv_bytes) * np.ones(steps - 1)
        gather = np.concatenate([[prefill["attention"].kv_bytes], decode_rows])
        attention = attention + 2.0 * gather / device.total_memory_bandwidth_bytes_per_s
    return {
        "dense": sum(both(name, chunk, b_dec) for name in DENSE_OPS),
        "ffn": np.concatenate([[ffn(b_pre * s_pre, chunk)], decode_ffn()]),
        "attention": attention,
        "head": op_seconds(head, device, dtype, b, cpu_gemm=linears) * np.ones(steps),
    }


def _kind_seconds(setting: Setting, b) -> MicroBatchSeconds:
    """micro_batch_seconds of a model whose layers are all of one kind; `b` as _mean_layer's."""
    arch, hw, steps = setting.arch, setting.hardware, setting.steps
    dtype, s_pre = setting.compute_dtype, setting.workload.prefill_len
    adt = dtype_bytes(ACTIVATION_DTYPE)
    # a CPU standing in for the GPU runs the CPU's GEMM paths and kernels
    # (hrm/hardware/stand_in.py), packed ones native: its layers stream, and a streamed run packs
    # nothing
    phases = _phase_ops(setting, b)  # the same ops, priced on each device
    cpu = _on_device(setting, b, phases, "cpu", hw.cpu, setting.cpu_gemm_choice)
    gpu_gemm = setting.cpu_gemm_choice.unpacked() if hw.stand_in else None
    gpu = _on_device(setting, b, phases, "gpu", hw.gpu, gpu_gemm)
    cpu_overhead = hw.cpu.launch_overhead_for(dtype)
    b_pre, b_dec = _sizes(b)
    hidden_page = b_pre * s_pre * arch.hidden_size * adt
    kv_token = arch.kv_token_bytes(setting.kv_dtype)  # K and V of one token in one layer

    def steps_of(seconds, prefill: float, decode) -> np.ndarray:
        return np.concatenate([[seconds(prefill)], seconds(decode) * np.ones(steps - 1)])

    def h2d(nbytes):
        return link_seconds(hw, nbytes, "h2d")

    def d2h(nbytes):
        return link_seconds(hw, nbytes, "d2h")

    def all_reduce(nbytes):
        return all_reduce_seconds(hw, nbytes)

    return MicroBatchSeconds(
        gpu_dense=gpu["dense"],
        gpu_ffn=gpu["ffn"],
        gpu_attention=gpu["attention"],
        cpu_dense=cpu["dense"],
        cpu_ffn=cpu["ffn"],
        cpu_attention=cpu["attention"],
        activations_to_gpu=steps_of(h2d, hidden_page, b_dec * arch.attention_output_size * adt),
        activations_to_cpu=steps_of(d2h, hidden_page, b_dec * (arch.q_size + arch.kv_width) * adt),
        # decode: a host layer's filled slots, a sliding layer's window at most
        # (executor/kv_cache.py); prefill: a later chunk's earlier tokens, fetched from the pool
        # as the device attends over them (executor/pass_tasks.py)
        kv_to_gpu=np.concatenate(
            [
                [h2d(b_pre * setting.prefill_prefix * kv_token) if setting.prefill_prefix else 0.0],
                h2d(b_dec * arch.mean_keys(setting.decode_contexts) * kv_token),
            ]
        ),
        kv_to_cpu=steps_of(d2h, b_pre * s_pre * kv_token, b_dec * kv_token),
        # two all-reduces of the micro-batch's hidden states per layer (Megatron: after the O
        # projection and after the expert FFN), prefill over all its prompt tokens
        gpu_all_reduce=2 * steps_of(all_reduce, hidden_page, b_dec * arch.hidden_size * adt),
        cpu_launch=launch_seconds(
            cpu_overhead,
            arch,
            steps,
            min(b_pre * s_pre, PREFILL_CHUNK_TOKENS),
            b_dec,
            # a stand-in's experts run the loop over unpacked pages, whatever the CPU's choice
            fused=not hw.stand_in and runs_fused(hw.cpu, dtype, setting.cpu_gemm_choice),
        ),
        gpu_launch=unhidden_gpu_launch(
            hw.gpu.launch_overhead_for(dtype) if hw.gpu is not None else None, gpu["dense"], steps
        ),
        head_gpu=gpu["head"],
        head_cpu=cpu["head"] + step_seconds(cpu_overhead),
        embed_to_gpu=h2d(b * arch.hidden_size * adt) * np.ones(steps),  # b: at each step
    )
