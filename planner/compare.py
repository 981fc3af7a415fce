"""Capacity planning across machines: the best plan per (machine, GPU count), side by side, with
cost per token where a price is known.

Each option is a full search (planner.search) of one machine using some of its GPUs in tensor
parallel (HardwareProfile.with_gpu_count); a count above the profile's is a what-if machine
with that many of its GPU, priced at the profile's price scaled by the GPU count. Cost per token
combines the predicted throughput with
a price per machine-hour the user gives or the profile carries:
  cost per million tokens = price_per_hour / (3600 * throughput) * 1e6
  dataset time = tokens / throughput;  dataset cost = dataset time / 3600 * price_per_hour
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.plan import Plan
from hrm.workload import Workload
from planner.evaluate import batch_model, component_seconds
from planner.search import NoPolicyFits, search
from planner.setting import Setting
from planner.transfers import check_tensor_parallel


@dataclass(frozen=True, kw_only=True)
class Option:
    """One machine with `gpus` of its GPUs: its best plan (None: fits no policy, and why)."""

    machine: str
    gpus: int  # 0 on a CPU-only machine
    plan: Plan | None
    why_not: str | None = None  # a sentence: "does not fit: ..." or "cannot plan: ..."
    price_per_hour: float | None = None
    all_reduce_share: float = 0.0  # of the GPU queue's busy time
    what_if: bool = False  # more GPUs than the profile has

    @property
    def label(self) -> str:
        if not self.gpus:
            return f"{self.machine} (CPU only)"
        plural = "s" if self.gpus != 1 else ""
        return f"{self.machine}, {self.gpus} GPU{plural}" + (" (what-if)" if self.what_if else "")

    @property
    def throughput_tok_s(self) -> float:
        return self.plan.predicted.throughput_tok_s if self.plan else 0.0

    @property
    def cost_per_million_tokens(self) -> float | None:
        if self.price_per_hour is None or not self.throughput_tok_s:
            return None
        return cost_per_million_tokens(self.price_per_hour, self.throughput_tok_s)

    def dataset_seconds(self, tokens: float) -> float | None:
        return tokens / self.throughput_tok_s if self.throughput_tok_s else None

    def dataset_cost(self, tokens: float) -> float | None:
        seconds = self.dataset_seconds(tokens)
        if seconds is None or self.price_per_hour is None:
            return None
        return seconds / 3600.0 * self.price_per_hour

    def to_dict(self, dataset_tokens: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "machine": self.machine,
            "gpus": self.gpus,
            "what_if": self.what_if,
            "throughput_tok_s": self.throughput_tok_s,
            "price_per_hour": self.price_per_hour,
            "cost_per_million_tokens": self.cost_per_million_tokens,
            "all_reduce_share": self.all_reduce_share,
            "plan": self.plan.to_dict() if self.plan else None,
            "why_not": self.why_not,
        }
        if dataset_tokens is not None:
            out["dataset_tokens"] = dataset_tokens
            out["dataset_seconds"] = self.dataset_seconds(dataset_tokens)
            out["dataset_cost"] = self.dataset_cost(dataset_tokens)
        return out


def cost_per_million_tokens(price_per_hour: float, throughput_tok_s: float) -> float:
    """USD per million generated tokens: price_per_hour / (3600 * throughput) * 1e6."""
    return price_per_hour / (3600.0 * throughput_tok_s) * 1e6


def parse_prices(text: str, machines: Sequence[str]) -> dict[str, float]:
    """`--price "t4=0.35,l4=0.70"` -> {name: USD per hour}; every name must be a listed machine.
    One machine may take a bare number (`--price 0.9`)."""
    if "=" not in text and len(machines) == 1:
        text = f"{machines[0]}={text}"
    elif "=" not in text:
        raise HrmError(
            f"--price {text.strip()!r}: with several machines name each, e.g. "
            f'"{machines[0]}=0.70,{machines[1]}=0.35"'
        )
    prices: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise HrmError(f"--price: expected NAME=USD_PER_HOUR, got {item!r}")
        if name not in machines:
            raise HrmError(
                f"--price: {name!r} is not in --hardware ({', '.join(machines)}); price only those"
            )
        try:
            price = float(value)
        except ValueError:
            raise HrmError(f"--price: {name}: {value.strip()!r} is not a number") from None
        if not price > 0 or price == float("inf"):
            raise HrmError(f"--price: {name}: the price must be positive, got {value.strip()}")
        prices[name] = price
    if not prices:
        raise HrmError("--price: give at least one NAME=USD_PER_HOUR")
    return prices


def plan_options(
    arch: ModelArch,
    machines: Mapping[str, HardwareProfile],
    workload: Workload,
    *,
    gpu_counts: Sequence[int] | None = None,
    prices: Mapping[str, float] | None = None,
    schedule: str = "cgopipe",
    dtype: str | None = None,
    kv_dtype: str | None = None,
    max_batch_size: int | None = None,
) -> list[Option]:
    """The best plan for each machine (keyed by the name the user gave) at each GPU count
    (default: all its GPUs), in `dtype` (default: each machine's faster 16-bit dtype). Counts
    and sharding are checked before any search."""
    jobs = []
    for key, hardware in machines.items():
        if not hardware.has_gpu:
            if gpu_counts:
                raise HrmError(f"--gpus: {hardware.name} has no GPU; leave it out of --hardware")
            jobs.append((key, 0, hardware))
            continue
        for count in gpu_counts or [hardware.gpu_count]:
            sized = hardware.with_gpu_count(count)
            check_tensor_parallel(arch, sized)
            jobs.append((key, count, sized))
    price_of = dict(prices or {})
    out = []
    for key, count, sized in jobs:
        weights = dtype or sized.half_dtype
        kv = kv_dtype or sized.compute_dtype(weights)
        options = {"schedule": schedule, "weight_dtype": weights, "kv_dtype": kv}
        own = machines[key]
        price = price_of.get(key, own.price_per_hour)
        what_if = count > own.gpu_count
        if what_if and price is not None:
            price *= count / own.gpu_count
        base = {"machine": key, "gpus": count, "price_per_hour": price, "what_if": what_if}
        unrated = sized.unrated(weights)
        if unrated:
            out.append(Option(**base, plan=None, why_not=f"cannot plan: {unrated}"))
            continue
        try:
            plan = search(
                arch, sized, workload, top_k=1, max_batch_size=max_batch_size, **options
            ).best
        except NoPolicyFits as exc:
            out.append(Option(**base, plan=None, why_not=f"does not fit: {exc}"))
            continue
        share = _all_reduce_share(arch, sized, workload, plan, options)
        out.append(Option(**base, plan=plan, all_reduce_share=share))
    return out


def _all_reduce_share(arch, hardware, workload, plan: Plan, options) -> float:
    """The all-reduces' share of the GPU queue's busy time in `plan`."""
    setting = Setting(arch=arch, hardware=hardware, workload=workload, **options)
    policy = plan.policy
    model = batch_model(setting, policy.batch_size, policy.micro_batch_size)
    gpu = component_seconds(model, policy)["gpu"]
    total = sum(gpu.values())
    return gpu["all-reduce"] / total if total else 0.0


def plot_options(options: Sequence[Option], path, title: str):
    """Throughput against cost per million tokens, one labelled point per priced option."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hrm.io import save_figure

    priced = [o for o in options if o.cost_per_million_tokens is not None]
    if not priced:
        raise HrmError("--plot draws throughput against cost: give --price for the machines")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for o in priced:
        ax.plot(o.cost_per_million_tokens, o.throughput_tok_s, "o", color="tab:blue")
        ax.annotate(o.label, (o.cost_per_million_tokens, o.throughput_tok_s), fontsize=8,
                    textcoords="offset points", xytext=(5, 4))  # fmt: skip
    ax.set_xlabel("cost per million generated tokens (USD)")
    ax.set_ylabel("best predicted throughput (tok/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out
