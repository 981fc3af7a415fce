"""A prompts file as editors and other tools save it: UTF-8 with a byte-order mark is read,
another encoding or a directory is one line naming the problem, in `hrm run` and `hrm plan`."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_one_line_error

LINES = [{"prompt_token_ids": [5, 6, 7]}, {"prompt": "w9 w8 é"}]
TEXT = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in LINES)
PLAN = ["plan", "--hardware", "l4", "--gen-len", "4", "--model"]


def run_prompts(run_cli, checkpoint, prompts):
    """`hrm run` of a prompts file, two new tokens each: (status, stdout, stderr)."""
    return run_cli("run", "--checkpoint", checkpoint, "--prompts", prompts, "--gen-len", "2",
                   "--quiet")  # fmt: skip


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (TEXT.encode("utf-16"), "p.jsonl: the prompts file is UTF-16 text; save it as UTF-8"),
        (TEXT.encode("utf-16-be"), "p.jsonl:1: the prompts file holds NUL bytes (UTF-16 text?)"),
        (TEXT.encode("utf-32"), "p.jsonl: the prompts file is UTF-32 text"),
        (TEXT.encode("latin-1"), "p.jsonl:2: the prompts file is not UTF-8 (byte 0xe9"),
    ],
)
def test_a_prompts_file_in_another_encoding_is_one_line(
    run_cli, tmp_path, mixtral_with_tokenizer, data, fragment
):
    """It was a UnicodeDecodeError's traceback (or, without a mark, 'not a JSON object')."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli(
        "run",
        "--checkpoint",
        mixtral_with_tokenizer,
        "--prompts",
        path,
        "--gen-len",
        "2",
        "--output",
        out,
        "--quiet",
    )
    assert_one_line_error(status, err, fragment)
    assert not out.exists()
    status, out_text, err = run_cli(*PLAN, mixtral_with_tokenizer, "--prompts", path)
    assert_one_line_error(status, err, fragment)
    assert out_text == ""


def test_a_byte_order_mark_is_read_past(run_cli, tmp_path, mixtral_with_tokenizer):
    """Notepad's UTF-8 carries a BOM: the same answers as the file without it (the first line
    was refused as not JSON)."""
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(TEXT, encoding="utf-8")
    marked.write_bytes(TEXT.encode("utf-8-sig"))
    outputs = []
    for path in (plain, marked):
        status, out, err = run_prompts(run_cli, mixtral_with_tokenizer, path)
        assert status == 0, err
        outputs.append(out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    status, _, err = run_cli(*PLAN, mixtral_with_tokenizer, "--prompts", marked)
    assert status == 0, err


def test_a_directory_as_prompts_says_it_is_one(run_cli, tmp_path, mixtral_with_tokenizer):
    status, _, err = run_prompts(run_cli, mixtral_with_tokenizer, tmp_path)
    assert_one_line_error(status, err, f"{tmp_path}: is a directory, not a prompts file")
    status, _, err = run_cli(*PLAN, mixtral_with_tokenizer, "--prompts", tmp_path)
    assert_one_line_error(status, err, "is a directory")


def test_a_line_break_inside_a_json_string_is_not_a_new_line(
    run_cli, tmp_path, mixtral_with_tokenizer
):
    """U+2028 is legal inside a JSON string; editors do not break the line there, so neither do
    we (output line i answers input line i)."""
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "w5\u2028w6"}, {"prompt_token_ids": [7]}]
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\r\n" for x in lines), "utf-8")
    status, out, err = run_prompts(run_cli, mixtral_with_tokenizer, path)
    assert status == 0, err
    assert len(out.splitlines()) == 2
