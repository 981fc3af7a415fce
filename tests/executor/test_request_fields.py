"""What a request line may say and what comes back: a plain line's own limits honoured and any
other key refused, OpenAI answers that carry their token ids (asked with return_token_ids, or
where there is no tokenizer to write text), chat roles, and messages that name a request by its
1-based line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hrm.errors import HrmError
from tests.conftest import assert_one_line_error
from tests.executor.test_requests import CHAT_TEMPLATE, chat, completion, run, write


@pytest.fixture(scope="module")
def bare(mixtral_with_tokenizer, tmp_path_factory) -> Path:
    """The tokenizer checkpoint's weights and config without its tokenizer: token ids only."""
    path = tmp_path_factory.mktemp("bare") / "mixtral-bare"
    path.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (mixtral_with_tokenizer / name).is_file():
            shutil.copy(mixtral_with_tokenizer / name, path / name)
    return path


@pytest.fixture(scope="module")
def chat_checkpoint(mixtral_with_tokenizer, tmp_path_factory) -> Path:
    """The tokenizer checkpoint with test_requests.py's chat template (ids are the words)."""
    path = tmp_path_factory.mktemp("chat") / "mixtral-chat"
    shutil.copytree(mixtral_with_tokenizer, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_plain_lines_own_limits_are_honoured_as_an_openai_requests_are(
    run_cli, tmp_path, mixtral_with_tokenizer
):
    """max_tokens, temperature, top_p, seed and stop in a plain line give the answer the same
    fields give in an OpenAI completion: the same ids, text and reason (they were ignored: every
    line ran to --gen-len, greedy)."""
    fields = [
        {"max_tokens": 3},
        {"max_tokens": 9, "temperature": 5.0, "top_p": 0.95, "seed": 7},
        {"max_tokens": 9, "stop": ["w200", "w201"]},
        {},
    ]
    prompts = [[9, 8, 40, 41], [17, 18, 19], [5, 6, 7], [11, 12]]
    plain = [{"prompt_token_ids": p, **f} for p, f in zip(prompts, fields, strict=True)]
    ours = run(
        run_cli, mixtral_with_tokenizer, write(tmp_path / "p.jsonl", plain), "--gen-len", "6"
    )
    openai = [
        completion(f"r{i}", p, return_token_ids=True, **({"max_tokens": 6} | f))
        for i, (p, f) in enumerate(zip(prompts, fields, strict=True))
    ]
    theirs = run(
        run_cli, mixtral_with_tokenizer, write(tmp_path / "o.jsonl", openai), "--gen-len", "6"
    )
    for line, answer in zip(ours, theirs, strict=True):
        (choice,) = answer["response"]["body"]["choices"]
        assert line["output_token_ids"] == choice["token_ids"]
        assert (line["text"], line["finish_reason"]) == (choice["text"], choice["finish_reason"])
    assert ours[0]["completion_tokens"] == 3 and ours[3]["completion_tokens"] == 6
    assert ours[1]["completion_tokens"] <= 6  # capped by --gen-len
    greedy = run(
        run_cli,
        mixtral_with_tokenizer,
        write(tmp_path / "g.jsonl", [{"prompt_token_ids": prompts[1]}]),
        "--gen-len",
        "6",
    )
    assert greedy[0]["output_token_ids"] != ours[1]["output_token_ids"]  # it did sample


def test_plain_lines_without_gen_len_take_their_own_max_tokens(run_cli, tmp_path, bare):
    lines = [
        {"prompt_token_ids": [5, 6], "max_tokens": 2},
        {"prompt_token_ids": [7], "max_tokens": 4},
    ]
    out = run(run_cli, bare, write(tmp_path / "p.jsonl", lines), "--ignore-eos")
    assert [line["completion_tokens"] for line in out] == [2, 4]


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (
            [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6], "max_token": 3}],
            "p.jsonl:2: 'max_token' is not supported in a plain line",
        ),
        ([{"prompt_token_ids": [5], "n": 2}], "p.jsonl:1: 'n' is not supported in a plain line"),
        ([{"prompt_token_ids": [5], "max_tokens": 0}], "p.jsonl:1: max_tokens must be a positive"),
        ([{"prompt_token_ids": [5], "top_p": 2}], "p.jsonl:1: top_p must be in (0, 1]"),
        ([{"prompt_token_ids": [5], "stop": "w9"}], "p.jsonl:1: stop strings, but"),
        (
            [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6, 999]}],
            "p.jsonl:2: token id 999 is outside the vocabulary",
        ),
        ([{"prompt": "w5"}], "p.jsonl:1: a text prompt, but"),
        (
            [completion("a", [5], max_tokens=2, return_token_ids="yes")],
            "p.jsonl:1: body.return_token_ids must be true or false",
        ),
    ],
)
def test_a_bad_line_is_one_line_naming_its_line(run_cli, tmp_path, bare, lines, fragment):
    """Refused before loading, exit 2, nothing written; the checkpoint has no tokenizer."""
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli(
        "run",
        "--checkpoint",
        bare,
        "--prompts",
        write(tmp_path / "p.jsonl", lines),
        "--gen-len",
        "4",
        "--output",
        out,
        "--quiet",
    )
    assert_one_line_error(status, err, fragment)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_chat_without_a_tokenizer_says_what_to_send_instead(run_cli, tmp_path, bare):
    path = write(
        tmp_path / "b.jsonl", [completion("a", [5], max_tokens=2), chat("b", "w5", max_tokens=2)]
    )
    status, _, err = run_cli("run", "--checkpoint", bare, "--prompts", path, "--quiet")
    assert_one_line_error(
        status,
        err,
        "b.jsonl:2: chat messages, but",
        "has no tokenizer",
        "/v1/completions requests with token ids",
    )


def test_a_completion_without_a_tokenizer_carries_its_token_ids(run_cli, tmp_path, bare):
    """No tokenizer, no text: the answer's ids are in its choice (as vLLM's token_ids), the same
    ids a plain line gets; they were lost (text "" and nothing else)."""
    prompts = [[5, 6, 7], [9, 8]]
    requests = [completion(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts)]
    answers = run(run_cli, bare, write(tmp_path / "o.jsonl", requests))
    plain = run(
        run_cli,
        bare,
        write(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts]),
        "--gen-len",
        "4",
    )
    for answer, line in zip(answers, plain, strict=True):
        body = answer["response"]["body"]
        (choice,) = body["choices"]
        assert choice["text"] == "" and choice["token_ids"] == line["output_token_ids"]
        assert body["usage"]["completion_tokens"] == len(line["output_token_ids"])
        assert "prompt_token_ids" not in choice  # not asked for


def test_return_token_ids_puts_them_where_vllm_does(run_cli, tmp_path, mixtral_with_tokenizer):
    """Asked: a completion's choice holds token_ids and prompt_token_ids; not asked, with text,
    neither is there."""
    requests = [
        completion("a", "w9 w8", max_tokens=3, return_token_ids=True),
        completion("b", "w9 w8", max_tokens=3),
    ]
    asked, plain = run(run_cli, mixtral_with_tokenizer, write(tmp_path / "o.jsonl", requests))
    (choice,) = asked["response"]["body"]["choices"]
    assert choice["prompt_token_ids"] == [9, 8]
    assert len(choice["token_ids"]) == asked["response"]["body"]["usage"]["completion_tokens"]
    (other,) = plain["response"]["body"]["choices"]
    assert "token_ids" not in other and "prompt_token_ids" not in other
    assert other["text"] == choice["text"]


def test_a_chat_answer_with_return_token_ids_has_the_prompts_in_its_body(
    run_cli, tmp_path, chat_checkpoint
):
    (line,) = run(
        run_cli,
        chat_checkpoint,
        write(tmp_path / "c.jsonl", [chat("a", "w5 w6", max_tokens=3, return_token_ids=True)]),
    )
    body = line["response"]["body"]
    assert body["prompt_token_ids"] == [1, 5, 6, 2, 3]  # the template's rendering
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]


def test_a_chat_role_outside_the_known_ones_is_refused(run_cli, tmp_path, chat_checkpoint):
    request = chat("a", "w5", max_tokens=2)
    request["body"]["messages"] = [
        {"role": "system", "content": "w4"},
        {"role": "bot", "content": "w5"},
    ]
    status, _, err = run_cli(
        "run",
        "--checkpoint",
        chat_checkpoint,
        "--prompts",
        write(tmp_path / "c.jsonl", [request]),
        "--quiet",
    )
    assert_one_line_error(
        status,
        err,
        "c.jsonl:1: body.messages[1].role 'bot' is not a chat role",
        "system, user, assistant, tool, developer",
    )
    from hrm.api import generate

    with pytest.raises(HrmError, match=r"requests\[0\]: messages\[0\].role 'robot'"):
        generate(chat_checkpoint, [{"messages": [{"role": "robot", "content": "w5"}]}], gen_len=2)


def test_the_python_apis_messages_name_the_request_as_its_list_does(bare):
    """requests[i], the list's own subscript, in every message: the vocabulary check said
    'prompt 2' of the same request."""
    from hrm.api import generate

    with pytest.raises(HrmError, match=r"^requests\[1\]: token id 999 is outside"):
        generate(bare, [[5], [6, 999]], gen_len=2)


def test_a_longer_answer_than_the_plan_holds_blames_what_asked_for_it(run_cli, tmp_path, bare):
    """Raising max_tokens past the plan's and resuming: the message named a --gen-len 8 that the
    user never gave; it says what asks for the tokens now."""
    plan = tmp_path / "plan.json"
    status, _, err = run_cli(
        "plan",
        "--model",
        bare,
        "--hardware",
        "l4",
        "--prompt-len",
        "3",
        "--gen-len",
        "4",
        "--dtype",
        "float32",
        "--policy",
        "N=2,mu=1,attn=cpu,ffn=gpu,w=0,kv=0",
        "-o",
        plan,
    )
    assert status == 0, err
    requests = write(tmp_path / "b.jsonl", [completion("a", [5, 6, 7], max_tokens=8)])
    status, _, err = run_cli(
        "run",
        "--checkpoint",
        bare,
        "--plan",
        plan,
        "--prompts",
        requests,
        "--output",
        tmp_path / "out.jsonl",
        "--resume",
        "--quiet",
        "--batching",  # continuous takes a request that fits the plan's KV memory
        "static",
    )
    assert_one_line_error(status, err, "up to 8 new tokens", "max_tokens", "the plan's 4")
    assert "--gen-len 8 exceeds" not in err
    assert json.loads(plan.read_text())["workload"]["gen_len"] == 4
