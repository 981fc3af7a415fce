"""The RunRecord of a finished run and its summary: one builder for `hrm run`, `hrm validate` and
the benches, whether the run was resident or planned.

The prediction is the planner's for the batches that ran: the run's policy at each batch's own
size and prompts, under its schedule, on the machine the caller names (the plan's, or this host's
stand-in; hrm/cli/run_plan.py `prediction_profile`), with the GEMM path the run took on a CPU.
"""

from __future__ import annotations

from hrm.units import format_percent


def run_record(spec, result, *, policy, schedule: str, profile=None, plan=None):
    """The RunRecord: the plan (None for a resident run), the prediction on `profile` (None: no
    prediction) and the measurement."""
    from hrm.record import RunRecord
    from planner import MODEL_VERSION

    predicted = None
    continuous = result.environment.get("continuous")
    if profile is not None and continuous and result.outputs:
        predicted = _predict_passes(spec, result, policy, schedule, profile)
    elif profile is not None and result.batches:
        predicted = _predict_batches(spec, result, policy, schedule, profile)
    environment = {**result.environment, "model_version": MODEL_VERSION}
    if plan is not None:
        environment["planned_memory"] = plan.memory.to_dict()
    hardware = profile.name if profile is not None else plan.hardware if plan is not None else None
    return RunRecord(
        model=spec.arch.name,
        hardware=hardware,
        # prefill packs the prompts (no compute on padding), so the workload is unpadded
        workload=spec.workload().to_dict(),
        plan=plan.to_dict() if plan is not None else None,
        predicted=predicted,
        measured=result.measured,
        environment=environment,
    )


def _predict_batches(spec, result, policy, schedule, profile) -> dict:
    """The planner's prediction summed over the batches that ran, and each resource's busy time;
    a data-parallel run's groups ran side by side: its time is its slowest group's, its tokens
    and busy time all of theirs (as executor/world.py combines the measurement)."""
    if result.groups is None:
        return _predict_group(spec, result.batches, result.cpu_gemm, policy, schedule, profile)
    return _side_by_side([_predict_group(spec, g, result.cpu_gemm, policy, schedule, profile)
                          for g in result.groups if g])  # fmt: skip


def _side_by_side(groups: list[dict]) -> dict:
    """Data-parallel groups' predictions combined: the slowest's time, every group's tokens and
    busy time."""
    if len(groups) == 1:
        return groups[0]
    slowest = max(groups, key=lambda p: p["prefill_s"] + p["decode_s"])
    busy: dict[str, float] = {}
    for p in groups:
        for q, s in p["busy_s"].items():
            busy[q] = busy.get(q, 0.0) + s
    tokens = sum(p["generated_tokens"] for p in groups)
    total_s = slowest["prefill_s"] + slowest["decode_s"]
    return {
        **slowest,
        "generated_tokens": tokens,
        "throughput_tok_s": tokens / total_s if total_s else 0.0,
        "busy_s": busy,
    }


def _predict_passes(spec, result, policy, schedule, profile) -> dict:
    """The planner's prediction of a continuous run: the requests that ran, through the
    executor's admission rule at the run's limits, each pass priced (planner/passes.py). A
    data-parallel run's groups each ran every groups-th request (executor/run.py) at the KV
    context its rank recorded, side by side."""
    env, ran = result.environment, sorted(result.outputs)
    if result.groups is None:
        return _priced_passes(spec, result, policy, schedule, profile, ran, env["kv_context"])
    groups, tp = env["data_parallel"], env["tensor_parallel"]
    leads = env["ranks"][::tp]  # a tensor-parallel group's first rank speaks for it
    shares = [[i for i in ran if i % groups == g] for g in range(groups)]
    return _side_by_side([
        _priced_passes(spec, result, policy, schedule, profile, share, lead["kv_context"])
        for share, lead in zip(shares, leads, strict=True) if share
    ])  # fmt: skip


def _priced_passes(spec, result, policy, schedule, profile, ran, context) -> dict:
    from hrm.rules.admission import Request
    from planner.passes import price_job
    from planner.setting import Setting

    env = result.environment
    requests = [Request(i, len(spec.prompts[i]), spec.max_new(i)) for i in ran]
    setting = Setting(arch=spec.arch, hardware=profile, workload=spec.workload(ran),
                      schedule=schedule, weight_dtype=policy.weight_dtype,
                      kv_dtype=policy.kv_dtype, cpu_gemm=result.cpu_gemm)  # fmt: skip
    price = price_job(setting, policy, requests, token_budget=env["token_budget"],
                      context_tokens=context, max_running=env.get("max_running"))  # fmt: skip
    return {
        "prefill_s": price.prefill_s,
        "decode_s": price.decode_s,
        "generated_tokens": price.generated_tokens,
        "throughput_tok_s": price.throughput_tok_s,
        "busy_s": price.busy_s,
        "passes": price.passes,
        "mean_sequences_per_pass": price.mean_sequences,
        "pass_seconds": list(price.pass_seconds),  # beside the measured ones, pass by pass
    }


def _predict_group(spec, batches, cpu_gemm, policy, schedule, profile) -> dict:
    """The planner's prediction of `batches` run one after another."""
    from planner.evaluate import predict_batch

    totals = {"prefill_s": 0.0, "decode_s": 0.0, "generated_tokens": 0}
    busy: dict[str, float] = {}
    for indices in batches:
        batch_plan = predict_batch(spec.arch, profile, spec.workload(indices), policy, schedule,
                                   len(indices), cpu_gemm=cpu_gemm)  # fmt: skip
        for key in totals:
            totals[key] += getattr(batch_plan.predicted, key)
        for q, s in batch_plan.busy_s.items():
            busy[q] = busy.get(q, 0.0) + s
    total_s = totals["prefill_s"] + totals["decode_s"]
    return {
        **totals,
        "throughput_tok_s": totals["generated_tokens"] / total_s if total_s else 0.0,
        "busy_s": busy,
    }


def format_summary(record) -> str:
    """What a run did and measured, in a few lines for stderr: the run and its speed; for a run
    that used more than the CPU, each queue's busy share and the link's bytes; the batches a
    resumed run skipped; the prediction and its error."""
    m, env = record.measured, record.environment
    passes = env.get("continuous")
    ran = (
        f"{passes['passes']} continuous passes (mean {passes['mean_sequences_per_pass']:.1f} "
        "sequences)"
        if passes
        else f"{env['batches_run']} {'batch' if env['batches_run'] == 1 else 'batches'}"
    )
    lines = [
        f"{record.model}: {env['prompts']} prompts in {ran} ({_how(record)}); "
        f"{m.generated_tokens} tokens, prefill {m.prefill_s:.3f} s, decode {m.decode_s:.3f} s, "
        f"{m.throughput_tok_s:.1f} tok/s"
    ]
    if any(f for q, f in m.busy_fraction.items() if q != "cpu"):
        lines.append(
            "busy: "
            + ", ".join(f"{q} {format_percent(f)}" for q, f in m.busy_fraction.items())
            + f"; link h2d {m.link_bytes['h2d'] / 1e6:.1f} MB, "
            f"d2h {m.link_bytes['d2h'] / 1e6:.1f} MB"
        )
    if env.get("batches_resumed"):
        what = "requests" if passes else "batches"
        lines.append(f"resumed: {env['batches_resumed']} {what} were already done")
    if record.predicted is not None:
        q = record.predicted
        lines.append(
            f"predicted on {record.hardware}: prefill {q['prefill_s']:.3f} s, decode "
            f"{q['decode_s']:.3f} s, {q['throughput_tok_s']:.1f} tok/s "
            f"({100 * record.prediction_error:+.0f}% against measured)"
        )
    return "\n".join(lines)


def _how(record) -> str:
    """N, mu and schedule of a planned run and where it ran; the dtype and device of a resident
    one."""
    env = record.environment
    if record.plan is None:
        return f"resident, {env['dtype']}, {env['device']}"
    p = record.plan["policy"]
    where = f"{env['device']} standing in for the GPU" if env["stand_in"] else env["device"]
    return f"N={p['batch_size']}, mu={p['micro_batch_size']}, {env['schedule']}, on {where}"
