"""Policy, Workload, Plan and RunRecord: strict, frozen, and round-tripping through their files."""

import dataclasses
import re

import pytest

from hrm.errors import HrmError
from hrm.plan import MemoryFootprint, Plan, Prediction
from hrm.policy import Policy
from hrm.record import Measurement, RunRecord
from hrm.workload import Workload

POLICY = Policy(
    batch_size=256,
    micro_batch_size=64,
    attention_on_gpu=False,
    ffn_on_gpu=True,
    weights_gpu_fraction=0.25,
    kv_gpu_fraction=0.0,
)
WORKLOAD = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128)


def _plan() -> Plan:
    return Plan(
        model="mixtral-8x7b",
        hardware="l4",
        workload=WORKLOAD,
        policy=POLICY,
        schedule="cgopipe",
        predicted=Prediction(prefill_s=10.0, decode_s=90.0, generated_tokens=256 * 128),
        busy_s={"gpu": 40.0, "cpu": 80.0, "h2d": 95.0, "d2h": 1.0},
        memory=MemoryFootprint(
            gpu={"resident_weights": 5e9, "paged_buffer": 2e9},
            cpu={"kv_cache": 9e9},
            gpu_capacity_bytes=20e9,
            cpu_capacity_bytes=150e9,
        ),
        bottleneck="h2d",
        binding_memory="gpu",
    )


def test_policy_is_frozen_keyword_only_and_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.batch_size = 1
    with pytest.raises(TypeError):
        Policy(256, 64, False, True, 0.25, 0.0)
    assert POLICY.num_micro_batches == 4
    with pytest.raises(HrmError, match="weights_gpu_fraction"):
        dataclasses.replace(POLICY, weights_gpu_fraction=25)  # a percent, not a fraction
    with pytest.raises(HrmError, match="exceeds batch_size"):
        dataclasses.replace(POLICY, micro_batch_size=512)
    with pytest.raises(HrmError, match="unknown dtype"):
        dataclasses.replace(POLICY, kv_dtype="int3")


def test_workload():
    assert WORKLOAD.prefill_len == 77 and WORKLOAD.max_context_len == 418 + 128
    assert dataclasses.replace(WORKLOAD, padding=True).prefill_len == 418
    assert Workload.from_prompt_lens([3, 5, 10], gen_len=4).prompt_len_mean == 6
    for bad in (dict(gen_len=0), dict(prompt_len_mean=-1), dict(prompt_len_mean=500)):
        with pytest.raises(HrmError):
            dataclasses.replace(WORKLOAD, **bad)


def test_plan_round_trips_through_json(tmp_path):
    plan = _plan()
    assert plan.predicted.throughput_tok_s == pytest.approx(256 * 128 / 100)
    assert plan.busy_fraction["h2d"] == pytest.approx(0.95)
    assert plan.memory.gpu_bytes == 7e9
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan


def test_plan_files_are_strict(tmp_path):
    data = _plan().to_dict()
    data["policy"]["batch_sise"] = 3
    with pytest.raises(HrmError, match="unknown key 'batch_sise'"):
        Plan.from_dict(data)
    data = _plan().to_dict()
    data["schedule"] = "zigzag"
    with pytest.raises(HrmError, match="unknown schedule 'zigzag'"):
        Plan.from_dict(data)


def test_a_plan_carries_its_machine_and_an_older_one_loads_without(tmp_path):
    """A plan stores the profile it was made on (a plan made with --hardware me.yaml named only
    "me", which `hrm run --plan` could not find); a plan from before that loads with none."""
    from hrm.hardware import resolve_hardware

    machine = dataclasses.replace(resolve_hardware("ci-cpu"), name="me")
    plan = dataclasses.replace(_plan(), hardware="me", machine=machine)
    assert Plan.load(plan.save(tmp_path / "plan.json")).machine == machine
    older = plan.to_dict()
    del older["machine"]
    assert Plan.from_dict(older).machine is None
    data = plan.to_dict()
    data["machine"]["cpu"]["speed"] = 1
    with pytest.raises(HrmError, match="plan: machine: cpu: unknown key 'speed'"):
        Plan.from_dict(data)


def test_run_record_round_trips_and_reports_error(tmp_path):
    record = RunRecord(
        model="tiny",
        hardware="ci-cpu",
        workload=WORKLOAD.to_dict(),
        plan=None,
        predicted=Prediction(prefill_s=1.0, decode_s=3.0, generated_tokens=400).to_dict(),
        measured=Measurement(
            prefill_s=1.0, decode_s=4.0, generated_tokens=400, peak_memory_bytes={"cpu": 1e9}
        ),
        environment={"torch": "2.13.0"},
    )
    assert record.measured.throughput_tok_s == 80.0
    assert record.prediction_error == pytest.approx((100 - 80) / 80)
    assert RunRecord.load(record.save(tmp_path / "run.json")) == record


def test_a_workload_of_requests_with_their_own_lengths():
    w = Workload.from_prompt_lens([10, 20, 30, 40], 99, answer_lens=[4, 2, 4, 1])
    assert w.gen_len == 4 and w.gen_lens == ((1, 1), (2, 1), (4, 2))
    assert w.gen_len_mean == 11 / 4
    assert list(w.decode_active) == [0.75, 0.5, 0.5]  # steps 1..3: longer than 1, 2, 3
    assert Workload.from_dict(w.to_dict()) == w
    assert (
        "gen_lens" not in WORKLOAD.to_dict() and Workload.from_dict(WORKLOAD.to_dict()) == WORKLOAD
    )
    same = Workload.from_prompt_lens([10, 20], 99, answer_lens=[7, 7])
    assert same.gen_len == 7 and same.gen_lens == ()


@pytest.mark.parametrize(
    ("gen_lens", "fragment"),
    [
        ([[4, 1], [9, 2]], "must be in [1, gen_len] and reach 8"),
        ([[8, 0]], "needs a positive count"),
        ([[8]], "gen_lens must be a list of [length, count] pairs"),
    ],
)
def test_a_workloads_bad_answer_lengths_are_refused(gen_lens, fragment):
    data = dict(WORKLOAD.to_dict(), gen_len=8, gen_lens=gen_lens)
    with pytest.raises(HrmError, match=re.escape(fragment)):
        Workload.from_dict(data)
