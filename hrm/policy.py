"""Policy: where each part of the model lives and runs, and how the batch is cut.

The paper's P = (N, mu, A_g, F_g, r_w, r_c) (reference, section 2), plus the dtypes. Fractions are
fractions (0..1), never percents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hrm.errors import HrmError
from hrm.formats import WEIGHT_FORMATS, is_compact
from hrm.schema import check_keys, dataclass_keys, fraction, positive_int

# the floating dtypes weights are computed in: what the executor runs, the profile sweeps and the
# planner prices GEMMs in (integer weights are dequantised into one of them)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# the weight dtypes the executor runs: floats, and the compact formats it quantizes to
RUN_DTYPES = (*FLOAT_DTYPES, *WEIGHT_FORMATS)
DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "float8": 1.0,
    "int4": 0.5,
}


def compute_bytes(weight_dtype: str) -> float:
    """Bytes of one weight as the layers compute it: a compact format (hrm/formats.py) is
    dequantized into a 16-bit float."""
    return 2.0 if is_compact(weight_dtype) else dtype_bytes(weight_dtype)


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise HrmError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, kw_only=True)
class Policy:
    batch_size: int  # N: sequences in one pass of the model
    micro_batch_size: int  # mu: sequences per GPU kernel launch
    attention_on_gpu: bool  # A_g
    ffn_on_gpu: bool  # F_g
    weights_gpu_fraction: float  # r_w: fraction of the weights resident on the GPU
    kv_gpu_fraction: float  # r_c: fraction of the KV cache on the GPU
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # r_d: fraction of the weights kept on disk (the disk tier), read from the checkpoint's files
    # each pass into pinned host memory; the host holds 1 - r_w - r_d of them
    weights_disk_fraction: float = 0.0

    def __post_init__(self) -> None:
        positive_int(self.batch_size, where="policy: batch_size")
        positive_int(self.micro_batch_size, where="policy: micro_batch_size")
        if self.micro_batch_size > self.batch_size:
            raise HrmError(
                f"policy: micro_batch_size {self.micro_batch_size} exceeds "
                f"batch_size {self.batch_size}"
            )
        fraction(self.weights_gpu_fraction, where="policy: weights_gpu_fraction")
        fraction(self.kv_gpu_fraction, where="policy: kv_gpu_fraction")
        fraction(self.weights_disk_fraction, where="policy: weights_disk_fraction")
        if self.weights_disk_fraction and not self.ffn_on_gpu:
            raise HrmError(
                "policy: weights_disk_fraction > 0 needs ffn_on_gpu: the disk tier keeps "
                "weights the GPU streams in"
            )
        if self.weights_gpu_fraction + self.weights_disk_fraction > 1.0 + 1e-9:
            raise HrmError(
                f"policy: weights_gpu_fraction {self.weights_gpu_fraction:g} and "
                f"weights_disk_fraction {self.weights_disk_fraction:g} add up to more than 1"
            )
        dtype_bytes(self.weight_dtype)
        dtype_bytes(self.kv_dtype)

    @classmethod
    def resident(
        cls, batch_size: int, dtype: str, on_gpu: bool, kv_dtype: str | None = None
    ) -> Policy:
        """A run held wholly by one device (`hrm run` without a plan): everything there, the
        whole batch one micro-batch; the KV cache in `kv_dtype` (default: `dtype`)."""
        return cls(
            batch_size=batch_size,
            micro_batch_size=batch_size,
            attention_on_gpu=on_gpu,
            ffn_on_gpu=on_gpu,
            weights_gpu_fraction=float(on_gpu),
            kv_gpu_fraction=float(on_gpu),
            weight_dtype=dtype,
            kv_dtype=kv_dtype or dtype,
        )

    @property
    def all_on_gpu(self) -> bool:
        """Every weight, the KV cache and all compute on the GPU: nothing to page or offload."""
        return (
            self.ffn_on_gpu
            and self.attention_on_gpu
            and self.weights_gpu_fraction == 1.0
            and self.kv_gpu_fraction == 1.0
        )

    @property
    def num_micro_batches(self) -> int:
        return math.ceil(self.batch_size / self.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "micro_batch_size": self.micro_batch_size,
            "attention_on_gpu": self.attention_on_gpu,
            "ffn_on_gpu": self.ffn_on_gpu,
            "weights_gpu_fraction": self.weights_gpu_fraction,
            "kv_gpu_fraction": self.kv_gpu_fraction,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
        } | ({"weights_disk_fraction": self.weights_disk_fraction}
             if self.weights_disk_fraction else {})  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> Policy:
        required, optional = dataclass_keys(cls)
        data = check_keys(data, where=where, required=required, optional=optional)
        return cls(**data)


POLICY_TEXT_KEYS = {
    "N": "batch size",
    "mu": "micro-batch size",
    "attn": "cpu|gpu",
    "ffn": "cpu|gpu",
    "w": "weights on the GPU, 0..1",
    "kv": "KV cache on the GPU, 0..1",
    "disk": "weights on disk, 0..1",
}


def parse_policy_text(text: str, *, weight_dtype: str, kv_dtype: str) -> Policy:
    """`--policy "N=504,mu=36,attn=cpu,ffn=gpu,w=0,kv=0"`: a policy named by hand (N and mu
    required; attention on the CPU, layers on the GPU, nothing resident by default)."""
    where = "--policy"
    values: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise HrmError(f"{where}: expected KEY=VALUE, got {item!r}")
        if key not in POLICY_TEXT_KEYS:
            allowed = ", ".join(f"{k} ({v})" for k, v in POLICY_TEXT_KEYS.items())
            raise HrmError(f"{where}: unknown key {key!r} (allowed: {allowed})")
        values[key] = value.strip()
    for key in ("N", "mu"):
        if key not in values:
            raise HrmError(f"{where}: give {key} ({POLICY_TEXT_KEYS[key]}), e.g. N=504,mu=36")

    def count(key: str) -> int:
        if not values[key].isdigit() or int(values[key]) < 1:
            raise HrmError(f"{where}: {key} must be a positive integer, got {values[key]!r}")
        return int(values[key])

    def device(key: str, default: str) -> bool:
        value = values.get(key, default).lower()
        if value not in ("cpu", "gpu"):
            raise HrmError(f"{where}: {key} must be cpu or gpu, got {value!r}")
        return value == "gpu"

    def share(key: str) -> float:
        try:
            value = float(values.get(key, "0"))
        except ValueError:
            raise HrmError(f"{where}: {key} must be a fraction 0..1, got {values[key]!r}") from None
        if not 0.0 <= value <= 1.0:
            raise HrmError(f"{where}: {key} must be a fraction between 0 and 1, got {value:g}")
        return value

    n, mu = count("N"), count("mu")
    if mu > n:
        raise HrmError(f"{where}: mu={mu} is larger than N={n}; a micro-batch is part of the batch")
    return Policy(
        batch_size=n,
        micro_batch_size=mu,
        attention_on_gpu=device("attn", "cpu"),
        ffn_on_gpu=device("ffn", "gpu"),
        weights_gpu_fraction=share("w"),
        kv_gpu_fraction=share("kv"),
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        weights_disk_fraction=share("disk"),
    )
