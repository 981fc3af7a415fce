"""executor/batching.py on its own: batches cut longest first and evened out over micro-batches,
the partial file a killed run leaves and resumes from, outputs in input order."""

from __future__ import annotations

import io
import json
import re

import pytest

from executor.batching import InOrder, PartialOutput, run_digest
from hrm.errors import HrmError
from hrm.rules.batches import plan_batches


def test_batches_are_cut_longest_first_and_evened_over_micro_batches():
    lens = [5, 9, 3, 7, 6, 2, 8, 4]
    batches = plan_batches(lens, batch_size=5, micro_batch_size=2)
    # longest first: 9 8 7 6 5 | 4 3 2
    assert [sorted(lens[i] for i in b.indices) for b in batches] == [[5, 6, 7, 8, 9], [2, 3, 4]]
    first = batches[0]
    assert first.micro_batch_sizes == (1, 2, 2)
    groups, start = [], 0
    for size in first.micro_batch_sizes:
        groups.append([lens[i] for i in first.indices[start : start + size]])
        start += size
    # each prompt joins the open micro-batch (fewer than mu) with the fewest tokens: 9 | 8 | 7,
    # then 6 joins the 7 (the fewest), and 5 the 8 (the 7 + 6 is full)
    assert groups == [[9], [8, 5], [7, 6]]
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lens)))
    assert plan_batches([4, 4, 4], 8, 8)[0].indices == (0, 1, 2)  # ties keep input order


def test_a_full_micro_batch_takes_no_more_however_few_its_tokens():
    """mu is a cap: the micro-batch with the fewest tokens is skipped once it holds mu."""
    (batch,) = plan_batches([10, 1, 1, 1], batch_size=4, micro_batch_size=2)
    assert batch.micro_batch_sizes == (2, 2)


def test_a_micro_batch_counts_all_its_tokens():
    """10 | 9 | 8 joins the 9 (17) | 2 and 1 join the 10 (10, 12 < 17): tokens add up; counting
    only the last prompt would put the 2 beside 9 and 8."""
    lens = [10, 9, 8, 2, 1]
    (batch,) = plan_batches(lens, batch_size=5, micro_batch_size=3)
    sizes = batch.micro_batch_sizes
    groups = [
        sorted((lens[i] for i in batch.indices[sum(sizes[:j]) : sum(sizes[: j + 1])]), reverse=True)
        for j in range(len(sizes))
    ]
    assert groups == [[10, 2, 1], [9, 8]]


def test_the_digest_names_the_prompts_and_the_settings():
    a = run_digest([[1, 2], [3]], {"gen_len": 4})
    assert a == run_digest([[1, 2], [3]], {"gen_len": 4})
    assert a != run_digest([[1, 2], [4]], {"gen_len": 4})
    assert a != run_digest([[1, 2], [3]], {"gen_len": 5})
    assert a != run_digest([[1], [2, 3]], {"gen_len": 4})
    # the settings' order does not matter; the digest is what partial files already carry
    two = {"gen_len": 4, "dtype": "bfloat16"}
    assert run_digest([[1]], two) == run_digest([[1]], dict(reversed(two.items())))
    assert len(a) == 16 and int(a, 16) >= 0


def test_a_partial_file_resumes_what_it_holds_and_cuts_a_torn_line(tmp_path):
    out = tmp_path / "out.jsonl"
    batches = plan_batches([3, 2, 1, 4], 2, 1)
    partial = PartialOutput(out, "run-a", resume=False)
    partial.append(batches[0].indices, [{"ids": [1]}, {"ids": [2]}])
    assert partial.saved() == 2
    with open(partial.path, "a") as f:
        f.write('{"index": 2, "ids": [')  # the kill tore the next line
    resumed = PartialOutput(out, "run-a", resume=True)
    assert set(resumed.done) == set(batches[0].indices)
    assert resumed.pending(batches) == batches[1:]
    assert not partial.path.read_text().endswith("[")  # the torn line is gone
    resumed.append(batches[1].indices, [{"ids": [3]}, {"ids": [4]}])
    resumed.finish(4)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    order = (*batches[0].indices, *batches[1].indices)
    by_index = dict(zip(order, [[1], [2], [3], [4]], strict=True))
    assert [line["ids"] for line in lines] == [by_index[i] for i in range(4)]
    assert not partial.path.exists()


@pytest.mark.parametrize(
    ("setup", "kwargs", "fragment"),
    [
        (None, {"resume": True}, "does not exist; run without --resume"),
        (
            "run-b",
            {"resume": True},
            "is from a different run (its prompts, plan or settings "
            "differ); remove it or run with the same arguments",
        ),
        ("run-a", {"resume": False}, "add --resume to continue it, or --overwrite"),
        ("garbage", {"resume": True}, "is not a partial output of hrm run"),
    ],
)
def test_a_partial_file_of_another_run_or_none_is_refused(tmp_path, setup, kwargs, fragment):
    out = tmp_path / "out.jsonl"
    if setup == "garbage":
        (tmp_path / "out.jsonl.partial").write_text("not json\n")
    elif setup is not None:
        PartialOutput(out, setup, resume=False).append([0], [{"ids": [1]}])
    with pytest.raises(HrmError, match=re.escape(fragment)):
        PartialOutput(out, "run-a", **kwargs)


def test_a_partial_file_of_a_header_alone_holds_no_output(tmp_path):
    """A kill between the header and the first lines: nothing to resume, and said so."""
    partial = PartialOutput(tmp_path / "out.jsonl", "run-a", resume=False)
    partial.append([], [])
    assert partial.path.read_text().count("\n") == 1 and partial.saved() == 0


@pytest.mark.parametrize("held", ["", "header"])
def test_a_resumed_file_gets_one_header_whatever_the_kill_left(tmp_path, held):
    """A kill right after the file was made (empty) or after its header: --resume goes on, and
    the file still starts with exactly one header, so a later resume reads it."""
    out = tmp_path / "out.jsonl"
    path = out.with_name("out.jsonl.partial")
    path.write_text("" if held == "" else json.dumps({"hrm_partial": {"run": "run-a"}}) + "\n")
    resumed = PartialOutput(out, "run-a", resume=True)
    assert resumed.done == {}
    resumed.append([0], [{"ids": [1]}])
    lines = path.read_text().splitlines()
    assert [("hrm_partial" in json.loads(line)) for line in lines] == [True, False]
    assert PartialOutput(out, "run-a", resume=True).done == {0: {"ids": [1]}}


def test_overwrite_discards_a_killed_runs_partial_file(tmp_path):
    out = tmp_path / "out.jsonl"
    PartialOutput(out, "run-a", resume=False).append([0], [{"ids": [1]}])
    fresh = PartialOutput(out, "run-a", resume=False, overwrite=True)
    assert not fresh.path.exists() and fresh.saved() == 0 and fresh.done == {}


def test_outputs_are_written_in_input_order_as_soon_as_they_can_be():
    stream = io.StringIO()
    order = InOrder(stream)
    order.add([2, 3], [{"i": 2}, {"i": 3}])
    assert stream.getvalue() == ""
    order.add([0], [{"i": 0}])
    assert [json.loads(x)["i"] for x in stream.getvalue().splitlines()] == [0]
    order.add([1], [{"i": 1}])
    assert [json.loads(x)["i"] for x in stream.getvalue().splitlines()] == [0, 1, 2, 3]


def test_a_data_parallel_group_without_a_file_resumes_from_nothing(tmp_path):
    """A kill can stop a group before its first batch: its file does not exist and it starts
    over; a single run's missing file under --resume is refused."""
    out = tmp_path / "out.jsonl"
    group = PartialOutput(out, "d" * 16, resume=True, part=1)
    assert group.path.name == "out.jsonl.partial.1" and group.done == {}
    with pytest.raises(HrmError, match="does not exist; run without --resume"):
        PartialOutput(out, "d" * 16, resume=True)
