"""`hrm plan --batching continuous`: the continuous plan (planner/continuous.py) of the job, the
prompts file's requests or, from lengths alone, 4 N requests of them, beside the best static
plan and MoE-Lens's stage-1 bound."""

from __future__ import annotations

import math
import time

from hrm.plan import Plan

# `hrm run` notes static batches only where they are predicted this much faster or more: a
# smaller gap is within the model's own error on real runs (hrm validate), no reason to
# switch
NOTE_BELOW = 0.95


def job_requests(workload, job, batch_size: int) -> list:
    """The requests simulated: the prompts file's (prompt, max_tokens), else 4 N requests of the
    mean prompt and the generation length (four generations of a static batch)."""
    from hrm.rules.admission import Request

    lengths = job.lengths if job is not None and job.lengths else (
        [(math.ceil(workload.prompt_len_mean), workload.gen_len)] * (4 * batch_size)
    )  # fmt: skip
    return [Request(i, p, g) for i, (p, g) in enumerate(lengths)]


def continuous_plan(arch, hardware, workload, job, static: list[Plan]) -> dict:
    """The continuous plan of the job over the `static` plans (best first), beside the same job
    in static batches of the best (_beside_static)."""
    requests = job_requests(workload, job, static[0].policy.batch_size)
    return _beside_static(arch, hardware, workload, requests, static)


def continuous_for_run(arch, hardware, workload, lengths, static: list[Plan]) -> dict:
    """The continuous plan of a run's own requests ((prompt length, max new tokens) each) over
    the `static` plans, what `hrm run --hardware` runs when it plans (continuous batching),
    beside the same requests in static batches of the best (_beside_static)."""
    from hrm.rules.admission import Request

    requests = [Request(i, p, g) for i, (p, g) in enumerate(lengths)]
    return _beside_static(arch, hardware, workload, requests, static)


def _beside_static(arch, hardware, workload, requests, static: list[Plan]) -> dict:
    """{"plan": the continuous plan of `requests` over the `static` plans (best first),
    "static_job": the same requests in static batches of the best, "static_plan": that best,
    "seconds": what both took}."""
    from planner.continuous import plan_continuous, price_static_job

    started = time.perf_counter()
    setting = _setting(arch, hardware, workload, static[0])
    plan = plan_continuous(setting, static, requests)
    batches = price_static_job(setting, static[0], requests)
    return {"plan": plan, "static_job": batches, "static_plan": static[0],
            "seconds": time.perf_counter() - started}  # fmt: skip


def static_faster_note(planned: dict) -> str | None:
    """A note for `hrm run` where the requests in static batches of the best static plan are
    predicted faster than the continuous plan (long generations where CPU attention binds:
    continuous attention first gathers each sequence's rows out of the pool); else None.
    `planned`: continuous_for_run's."""
    batches = planned["static_job"].throughput_tok_s
    rate = planned["plan"].continuous.predicted.throughput_tok_s
    if rate >= NOTE_BELOW * batches:
        return None
    return (
        f"note: continuous batching is predicted at {rate:.1f} tok/s for these requests, "
        f"{rate / batches:.2f}x static batches of N={planned['static_plan'].policy.batch_size} "
        f"({batches:.1f} tok/s); --batching static runs them that way"
    )


def _setting(arch, hardware, workload, best: Plan):
    from planner.setting import Setting

    return Setting(arch=arch, hardware=hardware, workload=workload, schedule=best.schedule,
                   weight_dtype=best.policy.weight_dtype,
                   kv_dtype=best.policy.kv_dtype)  # fmt: skip


def describe(planned: dict, bound_rate: float) -> str:
    plan, batches = planned["plan"], planned["static_job"]
    c, p = plan.continuous, plan.policy
    rate = c.predicted.throughput_tok_s
    where = lambda on_gpu: "GPU" if on_gpu else "CPU"  # noqa: E731
    return (
        f"continuous  {rate:.1f} tok/s, {rate / batches.throughput_tok_s:.2f}x the same "
        f"{c.requests} requests in static batches of the best plan "
        f"({batches.throughput_tok_s:.1f} tok/s), {rate / bound_rate:.0%} of the bound\n"
        f"            {c.passes} passes, up to {c.max_running} requests running (at most "
        f"{c.peak_running} did) and "
        f"{c.token_budget} tokens a pass; KV pool of N={p.batch_size} at the longest context "
        f"(peak {c.peak_kv_blocks} blocks reserved), mu={p.micro_batch_size} attention "
        f"{where(p.attention_on_gpu)} FFN {where(p.ffn_on_gpu)} weights-on-GPU "
        f"{p.weights_gpu_fraction:.0%} KV-on-GPU {p.kv_gpu_fraction:.0%}"
    )


def to_json(planned: dict, bound_rate: float) -> dict:
    plan, batches = planned["plan"], planned["static_job"]
    rate = plan.continuous.predicted.throughput_tok_s
    return plan.continuous.to_dict() | {
        "throughput_tok_s": rate,
        "policy": plan.policy.to_dict(),
        "static_job": batches.to_dict(),
        "over_static": rate / batches.throughput_tok_s,
        "share_of_bound": rate / bound_rate,
        "planned_in_s": planned["seconds"],
    }
