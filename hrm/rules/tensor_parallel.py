"""What tensor parallelism over tp GPUs can split: one rule that the planner (which refuses to
plan what cannot run) and the executor (executor/tensor_parallel.py, which shards by it) share.

Megatron-style, each GPU takes 1/tp of the query heads, of the key/value heads (latent
attention's one latent is whole on every GPU), of every expert's, shared expert's and dense
MLP's width, and of the LM head's vocabulary: each must divide by tp.
"""

from __future__ import annotations

from hrm.arch import ModelArch


def tensor_parallel_problem(arch: ModelArch, tp: int) -> str | None:
    """Why `arch` cannot be split over tp ranks (None: it can)."""
    if tp == 1:
        return None
    if arch.qk_norm == "projection":
        return (
            f"{arch.name} has q/k norms over the whole projection, which tensor-parallel runs "
            "do not split yet; plan with --gpus 1"
        )
    sizes = (
        ("num_attention_heads", arch.num_attention_heads),
        # (latent attention's one latent head is whole on every rank)
        ("num_key_value_heads", tp if arch.kv_lora_rank else arch.num_key_value_heads),
        ("intermediate_size", arch.intermediate_size),
        ("shared_expert_intermediate_size", arch.shared_expert_intermediate_size),
        ("dense_intermediate_size", arch.dense_intermediate_size),
        ("vocab_size", arch.vocab_size),
    )
    for name, value in sizes:
        if value % tp:
            return (
                f"{arch.name}: {name} = {value} does not divide by {tp} GPUs in tensor "
                "parallel; plan with a GPU count that divides it"
            )
    return None
