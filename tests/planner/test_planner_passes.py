"""Continuous batching priced pass by pass (planner/passes.py): a pass of equal groups is the
static model's step, a mixed pass overlaps its groups as the schedule does, and a job's passes
are the executor's admission rule replayed."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.plan import Plan
from hrm.policy import parse_policy_text
from hrm.rules.admission import Request, expand, kv_blocks, simulate, token_budget_limit
from hrm.rules.batches import plan_batches
from hrm.workload import Workload
from planner import predict
from planner.continuous import plan_continuous, price_static_job
from planner.memory import activation_tokens
from planner.passes import CPU, D2H, GPU, H2D, PassPricer, _grid_points, pass_groups, price_job
from planner.search import search
from planner.setting import Setting
from planner.transfers import link_seconds
from tests.conftest import assert_one_line_error

ARCH = resolve_model("mixtral-8x7b")
CASES = [
    ("N=64,mu=64,w=0,kv=0,attn=cpu,ffn=gpu", "cgopipe"),
    ("N=64,mu=16,w=0.1,kv=0,attn=cpu,ffn=gpu", "cgopipe"),
    ("N=64,mu=16,w=0.1,kv=0,attn=cpu,ffn=gpu", "serial"),
    ("N=64,mu=16,w=0.1,kv=0,attn=cpu,ffn=gpu", "overlap"),
    ("N=64,mu=16,w=0,kv=0.5,attn=gpu,ffn=gpu", "gpu-attention"),
]


def pricer(text: str, schedule: str, hardware="l4", prompt=99):
    policy = parse_policy_text(text, weight_dtype="bfloat16", kv_dtype="bfloat16")
    workload = Workload(prompt_len_mean=prompt, prompt_len_max=prompt, gen_len=2)
    hw = resolve_hardware(hardware)
    setting = Setting(arch=ARCH, hardware=hw, workload=workload, schedule=schedule,
                      weight_dtype="bfloat16", kv_dtype="bfloat16")  # fmt: skip
    plan = predict(ARCH, hw, workload, policy, schedule)
    return PassPricer(setting, plan.policy), plan


@pytest.mark.parametrize(("text", "schedule"), CASES)
def test_a_pass_of_equal_groups_is_the_static_step(text, schedule):
    """m groups of mu decodes at context 100 are a static decode step of N at 99 + 1, exactly;
    m groups of mu prompts of 99 are its prefill (a chunk priced at the bucket above its
    length, 6% at most: the pass's shapes are priced once each)."""
    p, plan = pricer(text, schedule)
    m, mu = plan.policy.num_micro_batches, plan.policy.micro_batch_size
    decode = p.price([("decode", mu, 100.0)] * m)
    prefill = p.price([("prefill", mu, 99.0)] * m)
    assert decode == pytest.approx(plan.predicted.decode_s, rel=1e-9)
    assert prefill == pytest.approx(plan.predicted.prefill_s, rel=2e-3)


def test_a_decode_group_between_two_contexts_is_priced_between_them():
    """A group's mean context is priced exactly: at a whole number as the static step there,
    between two as the line between them, and a context past the table's end grows it."""
    p, _ = pricer(*CASES[1])
    at = {c: p.group("decode", 16, c) for c in (300.0, 301.0, 300.25, 5000.0)}
    assert at[300.25] == pytest.approx(0.75 * at[300.0] + 0.25 * at[301.0], rel=1e-12)
    assert (at[300.0] <= at[300.25]).all() and at[300.0][CPU] < at[301.0][CPU]  # CPU attention
    assert at[5000.0][CPU] > at[301.0][CPU] and len(p.shapes["decode", 16]) >= 4999


def test_a_paged_decode_group_pays_its_gather_at_the_memory_bandwidth():
    """Continuous batching's pools: a decode group's CPU attention (attn=cpu) costs the static
    step's plus the gather, its K/V bytes read and written once at the host's bandwidth; the
    GPU's terms are unchanged."""
    p, plan = pricer(*CASES[1])
    paged = PassPricer(p.setting.alike(paged_kv_cache=True), plan.policy)
    for context in (100.0, 1000.0):
        plain, gathered = p.group("decode", 16, context), paged.group("decode", 16, context)
        keys_read = 16 * context * ARCH.kv_token_bytes("bfloat16")  # one layer's K and V
        gather = 2 * keys_read / p.setting.hardware.cpu.total_memory_bandwidth_bytes_per_s
        assert gathered[CPU] - plain[CPU] == pytest.approx(gather, rel=1e-9)
        assert gathered[GPU] == plain[GPU]


def test_a_decode_group_is_priced_at_its_longest_context():
    """The executor gathers and attends every sequence of a group to its longest: pass_groups
    gives a decode group that context (position of the token fed + 1), not the mean; decodes
    are cut shortest first, so that like lengths share a group."""
    from hrm.rules.admission import Chunk, Pass

    p = Pass(decodes=((0, 10), (1, 300), (2, 40)), chunks=(Chunk(index=3, start=0, length=20,
                                                                last=True),))  # fmt: skip
    assert pass_groups(p, 2) == [("decode", 2, 41), ("decode", 1, 301), ("prefill", 1, 20.0, 0.0)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 500), max_size=40),
       st.lists(st.tuples(st.integers(0, 300), st.integers(1, 200)), max_size=10),
       st.integers(1, 9))  # fmt: skip
def test_pass_groups_are_the_executors_groups(positions, chunks, mu):
    """pass_groups cuts a pass from its arrays; each group is Pass.groups' (what the executor
    runs): its size, a decode group's longest context, a chunk group's mean chunk and start."""
    from hrm.rules.admission import Chunk, Pass

    p = Pass(decodes=tuple(enumerate(positions)),
             chunks=tuple(Chunk(index=1000 + j, start=s, length=n, last=False)
                          for j, (s, n) in enumerate(chunks)))  # fmt: skip
    expected = [("decode", len(e), 1 + max(pos for _, pos in e)) if phase == "decode" else
                ("prefill", len(e), sum(c.length for c in e) / len(e),
                 sum(c.start for c in e) / len(e)) for phase, e in p.groups(mu)]  # fmt: skip
    assert pass_groups(p, mu) == expected


def test_a_later_chunk_is_priced_with_its_attention_over_the_prompts_earlier_tokens():
    """A prompt cut across passes: pass_groups gives a chunk group its chunks' mean start, and
    its price adds, where prefill attention runs (here the GPU, with the layers), the attention
    of its queries over those earlier keys: the roofline's attention at context start + chunk
    less at the chunk alone (both between the points of the pricer's grid either side, weighted
    linearly: 100 between 81 and 102); and their K and V brought over the link, the pool being
    on the host."""
    from hrm.roofline.ops import attention_op
    from hrm.rules.admission import Chunk, Pass
    from planner.op_time import op_seconds

    chunks = (Chunk(index=0, start=0, length=60, last=False),
              Chunk(index=1, start=200, length=68, last=True))  # fmt: skip
    assert pass_groups(Pass(decodes=(), chunks=chunks), 2) == [("prefill", 2, 64.0, 100.0)]
    p, _ = pricer(*CASES[1])
    first, later = p.group("prefill", 16, 64.0), p.group("prefill", 16, 64.0, 100.0)
    gpu = p.setting.hardware.gpu

    def attention(context):
        op = attention_op(ARCH, batch=16, new_tokens=64, context=context, kv_dtype="bfloat16")
        return op_seconds(op, gpu, "bfloat16", 16 * 64)

    lengths, starts = _grid_points(64.0, 16), _grid_points(100.0, 0)  # as priced
    assert len(lengths) == 1 and len(starts) == 2
    extra = sum(wl * ws * attention(s + c) for c, wl in lengths for s, ws in starts) - sum(
        wl * attention(c) for c, wl in lengths
    )
    assert later[GPU] - first[GPU] == pytest.approx(extra, rel=1e-9)
    assert later[GPU] > first[GPU] and later[CPU] == first[CPU]
    # the host's K and V of those earlier tokens cross the link to the device, layer by layer
    # (executor/pass_tasks.py's kv_in): a layer's, 16 prompts x 100 tokens x a token's K and V
    trip = sum(ws * link_seconds(p.setting.hardware, 16 * s * ARCH.kv_token_bytes("bfloat16"),
                                 "h2d") for s, ws in starts)  # fmt: skip
    assert later[H2D] - first[H2D] == pytest.approx(trip, rel=1e-9)
    assert later[D2H] == first[D2H]
    assert p.group("prefill", 16, 64.0, 0.0) is first


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 100_000), st.sampled_from([0, 16]))
def test_a_shape_is_priced_between_the_grid_points_either_side(tokens, exact):
    """_grid_points: at most two points, the value itself to `exact`, else points of one grid
    (so groups of nearby shapes share them), with positive weights that add to 1 and give the
    value back (linear interpolation); every power of two from 16 is a point of its own."""
    points = _grid_points(float(tokens), exact)
    assert 1 <= len(points) <= 2 and all(w > 0 for _, w in points)
    assert sum(w for _, w in points) == pytest.approx(1.0)
    assert sum(x * w for x, w in points) == pytest.approx(tokens)
    grid = {0.0, 16.0} | {float(round(16 * 2 ** (k / 3))) for k in range(60)}
    if tokens > exact:
        assert {x for x, _ in points} <= grid
    if tokens >= 16 and tokens & (tokens - 1) == 0:
        assert points == ((float(tokens), 1.0),)


def test_a_mixed_pass_overlaps_its_groups_and_streams_the_weights_once():
    p, _ = pricer(*CASES[1])
    decode, prefill = ("decode", 16, 300.0), ("prefill", 16, 64.0)
    both = p.price([decode, decode, prefill])
    alone = p.price([decode, decode]), p.price([prefill])
    assert max(alone) <= both < sum(alone)  # one weight stream, not two


def test_a_jobs_passes_are_the_admission_rules_and_their_prices_add_up():
    p, plan = pricer(*CASES[1])
    requests = [Request(i, 20 + 7 * i % 90, 4 + 5 * i % 40) for i in range(150)]
    limits = dict(max_running=64, token_budget=16 * 99 + 64, total_blocks=kv_blocks(64, 139))
    passes = list(expand(simulate(requests, **limits)[0]))
    price = price_job(p.setting, plan.policy, requests, token_budget=limits["token_budget"],
                      context_tokens=139)  # fmt: skip
    assert price.passes == len(passes)
    assert price.generated_tokens == sum(r.max_new for r in requests)
    assert price.seconds == pytest.approx(price.prefill_s + price.decode_s)
    assert price.prefill_s > 0 and price.decode_s > 0


def test_hrm_plan_prices_the_job_continuously_beside_static(run_cli, tmp_path):
    """The continuous plan's job beside the same requests in the best static plan's batches."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [1] * (10 + i % 50),
                                           "max_tokens": 4 + i % 60}) + "\n"
                               for i in range(300)))  # fmt: skip
    args = ["plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompts", prompts]
    status, out, err = run_cli(*args, "--batching", "continuous", "--json")
    assert status == 0, err
    data = json.loads(out)
    c, job = data["continuous"], data["continuous"]["static_job"]
    assert c["requests"] == 300 and c["passes"] > 0 and c["throughput_tok_s"] > 0
    assert job["generated_tokens"] == c["predicted"]["generated_tokens"] == data["job"]["tokens"]
    assert c["over_static"] == pytest.approx(c["throughput_tok_s"] / job["throughput_tok_s"])
    assert c["peak_running"] <= c["max_running"]
    status, out, err = run_cli(*args, "--batching", "continuous")
    assert status == 0, err
    assert re.search(r"continuous +[\d.]+ tok/s, [\d.]+x the same 300 requests in static batches",
                     out), out  # fmt: skip
    status, _, err = run_cli(*args, "--batching", "rolling")
    assert status == 2 and "invalid choice: 'rolling'" in err


def _mixed(count: int) -> list[Request]:
    return [Request(i, 10 + 37 * i % 500, 16 + 53 * i % 241) for i in range(count)]


def test_the_continuous_plan_admits_more_than_n_and_beats_the_static_plans_n():
    """Mixed lengths book less than the longest context each, so the continuous plan runs more
    requests than the static N from the same pool, within the pool and the pass's memory, and
    prices above running N at once; its limits replay to the passes it predicted."""
    requests = _mixed(400)
    workload = Workload.from_prompt_lens([r.prompt_len for r in requests], 256, False,
                                         [r.max_new for r in requests])  # fmt: skip
    hw = resolve_hardware("l4")
    static = search(ARCH, hw, workload, top_k=5, max_batch_size=128).top  # a smaller pool
    setting = Setting(arch=ARCH, hardware=hw, workload=workload)
    plan = plan_continuous(setting, static, requests)
    c, pol, context = plan.continuous, plan.policy, workload.max_context_len
    assert plan.policy in [p.policy for p in static]
    at_n = price_job(setting, pol, requests, context_tokens=context,
                     token_budget=token_budget_limit(pol.batch_size, pol.micro_batch_size,
                                                     workload.prompt_len_max))  # fmt: skip
    assert c.predicted.throughput_tok_s >= at_n.throughput_tok_s
    assert c.max_running > pol.batch_size and c.peak_kv_blocks <= kv_blocks(pol.batch_size, context)
    assert c.token_budget <= activation_tokens(ARCH, workload, batch_size=pol.batch_size,
                                               micro_batch_size=pol.micro_batch_size,
                                               ffn_on_gpu=pol.ffn_on_gpu)  # fmt: skip
    spans, _ = simulate(requests, max_running=c.max_running, token_budget=c.token_budget,
                         total_blocks=kv_blocks(pol.batch_size, context))  # fmt: skip
    assert len(list(expand(spans))) == c.passes and c.requests == 400
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_hrm_plan_writes_the_continuous_plan_and_refuses_a_broken_one(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [1] * r.prompt_len,
                                           "max_tokens": r.max_new}) + "\n"
                               for r in _mixed(400)))  # fmt: skip
    out = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompts",
                             prompts, "--batching", "continuous", "--max-batch-size", "128", "-o",
                             out)  # fmt: skip
    assert status == 0, err
    data = json.loads(out.read_text())
    assert data["continuous"]["max_running"] > data["policy"]["batch_size"]
    data["continuous"]["max_running"] = 0
    out.write_text(json.dumps(data))
    status, _, err = run_cli("run", "--model", "mixtral-8x7b", "--random-weights", "--layers",
                             "1", "--plan", out, "--batch", "2", "--prompt-len", "4",
                             "--gen-len", "2")  # fmt: skip
    assert_one_line_error(status, err, "continuous: max_running: must be a positive integer")


def test_the_static_job_is_the_executors_batches_each_priced_at_its_size():
    """A job of 2.5 N requests is three static batches: two of N and one of N/2, each priced
    by the model at its own size and lengths."""
    requests = [Request(i, 40 + i % 7, 8 + i % 5) for i in range(160)]
    p, plan = pricer("N=64,mu=16,w=0.1,kv=0,attn=cpu,ffn=gpu", "cgopipe")
    job = price_static_job(p.setting, plan, requests)
    batches = plan_batches([r.prompt_len for r in requests], 64, 16)
    assert [len(b.indices) for b in batches] == [64, 64, 32]
    alone = []
    for b in batches:
        members = [requests[i] for i in b.indices]
        answers = [r.max_new for r in members]
        workload = Workload.from_prompt_lens([r.prompt_len for r in members], max(answers),
                                             False, answers)  # fmt: skip
        n = len(members)
        at = dataclasses.replace(plan.policy, batch_size=n, micro_batch_size=min(n, 16))
        alone.append(predict(ARCH, p.setting.hardware, workload, at, "cgopipe",
                             padded_kv_cache=True).predicted.total_s)  # fmt: skip
    assert job.total_s == pytest.approx(sum(alone))
    assert job.generated_tokens == sum(r.max_new for r in requests)
    assert alone[2] < alone[0]  # the short batch is priced short


def test_a_run_is_told_where_static_batches_are_predicted_faster():
    """`hrm run --hardware` plans continuously by default; where the same requests in static
    batches are predicted at least 5% faster (here 512-token generations of one length on the
    L4, where CPU attention binds and continuous attention gathers from the pool), it says so
    and how to run them; a mixed job within that margin gets no note."""
    from hrm.cli.plan_continuous import continuous_for_run, static_faster_note

    hw = resolve_hardware("l4")
    jobs = {"long": [(100, 512)] * 256,
            "mixed": [(20 + 7 * i % 380, (16, 64, 256)[i % 3]) for i in range(256)]}  # fmt: skip
    notes = {}
    for name, lengths in jobs.items():
        workload = Workload.from_prompt_lens([p for p, _ in lengths], max(g for _, g in lengths),
                                             False, [g for _, g in lengths])  # fmt: skip
        result = search(ARCH, hw, workload, top_k=5, max_batch_size=len(lengths))
        planned = continuous_for_run(ARCH, hw, workload, lengths, list(result.top))
        notes[name] = static_faster_note(planned)
    assert notes["mixed"] is None
    rate = re.search(r"(\d\.\d\d)x static batches of N=256", notes["long"])
    assert rate and float(rate[1]) < 0.95 and "--batching static" in notes["long"]
