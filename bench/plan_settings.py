"""Settings of reports/plans.md: the paper's machines, models and workloads (reference, s. 4)."""

from __future__ import annotations

from dataclasses import dataclass

from hrm.workload import Workload

MACHINES = (
    ("mixtral-8x7b", "t4"),
    ("mixtral-8x7b", "l4"),
    ("mixtral-8x22b", "2xt4"),
    ("mixtral-8x22b", "4xt4"),
    ("dbrx", "2xt4"),
    ("dbrx", "4xt4"),
    ("qwen3-30b-a3b", "l4"),
    ("qwen3-235b-a22b", "4xt4"),
)
# Families beyond the paper's (issue 36), with the weight format each row plans: gpt-oss-120b
# (233 GB in 16 bits) and GLM-4.5-Air (214 GB) do not fit an L4 machine's 192 GB host in 16
# bits, so their L4 rows stream int4 weights (gpt-oss is released in MXFP4, 4.25 bits a weight;
# int4 is the compact format hrm streams, 4.5); on an H100 machine's 1 TB host, 16 bits.
FAMILIES = (
    ("gpt-oss-120b", "l4", "int4"),
    ("gpt-oss-120b", "h100-sxm", "bfloat16"),
    ("glm-4.5-air", "l4", "int4"),
    ("glm-4.5-air", "h100-sxm", "bfloat16"),
)
# DeepSeek-V3 (671B) on 8 GPUs (issue 36): each machine's profile with 8 of its GPU (a what-if
# where the profile has one: each GPU with its own link), in 16 bits and int4 weights
EIGHT_GPUS = (
    ("deepseek-v3", "h100-sxm", "bfloat16"),
    ("deepseek-v3", "h100-sxm", "int4"),
    ("deepseek-v3", "h200-sxm", "bfloat16"),
    ("deepseek-v3", "a100-80g", "bfloat16"),
    ("deepseek-v3", "l4", "int4"),
)

# Host memory beyond the bundled profile's, by (model, machine): Qwen3-235B-A22B is 470 GB in
# 16 bits, more than 4xt4.yaml's 416 GB host; a 4xT4 cloud machine is offered with 624 GB
# (GCP n1-highmem-96), which its row assumes, as `hrm plan --cpu-mem 624GB` does.
HOST_MEMORY = {("qwen3-235b-a22b", "4xt4"): 624e9}


# Tensor-parallel scaling rows: these models on the 4xT4 machine using 1, 2 and 4 of its GPUs.
SCALING_MODELS = ("mixtral-8x22b", "dbrx")
SCALING_MACHINE = "4xt4"
SCALING_GPUS = (1, 2, 4)

# The cost table's machines, with example prices in USD per machine-hour. They are round
# examples of on-demand cloud rates for one such GPU and its host, not quotes: give your own with
# `hrm plan --price`.
EXAMPLE_PRICES = {"t4": 0.35, "l4": 0.70, "a100-80g": 3.70, "h100-sxm": 7.00, "h200-sxm": 10.00}


@dataclass(frozen=True)
class NamedWorkload:
    name: str
    workload: Workload


def workloads() -> list[NamedWorkload]:
    """MTBench-like (prompt mean 77, max 418; generation 32-256; padded and not) and HELM-like."""
    out = []
    for gen in (32, 64, 128, 256):
        for padding in (False, True):
            name = f"mtbench g{gen}" + (" (p)" if padding else "")
            out.append(
                NamedWorkload(
                    name,
                    Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=gen, padding=padding),
                )
            )
    out.append(
        NamedWorkload(
            "helm-reasoning g50", Workload(prompt_len_mean=242, prompt_len_max=256, gen_len=50)
        )
    )
    out.append(
        NamedWorkload(
            "helm-xsum g64", Workload(prompt_len_mean=1693, prompt_len_max=1984, gen_len=64)
        )
    )
    return out


# The disk tier (issue 50): models whose weights the host cannot hold, by (model, machine, GPUs,
# weights, host memory: None for the profile's). DeepSeek-V3 is 1.34 TB in 16 bits (0.38 TB in
# int4), Qwen3-235B-A22B 470 GB (0.13 TB): the 8 x A100 host has 512 GB, the L4's 192 GB.
DISK_PLANS = (
    ("deepseek-v3", "a100-80g", 8, "bfloat16", None),
    ("deepseek-v3", "a100-80g", 8, "int4", None),
    ("deepseek-v3", "h100-sxm", 1, "bfloat16", 256e9),
    ("deepseek-v3", "h100-sxm", 1, "int4", 256e9),
    ("qwen3-235b-a22b", "l4", 1, "bfloat16", None),
    ("qwen3-235b-a22b", "l4", 1, "int4", None),
)
