"""Request files as users write them (OpenAI's batch format, chat templates, per-request limits),
run by `hrm run` and answered as OpenAI's batch output, against transformers' own generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from executor.checkpoint import open_checkpoint
from executor.generate import Limits, Sampling, generate
from executor.model import MoEModel
from executor.runtime import placed_runtime
from tests.conftest import assert_one_line_error, record_flags
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_matches_transformers import reference_generate
from tests.executor.test_offload import SCHEDULES, policy

# the word-level tokenizer's ids are its words: "w5 w6" <-> [5, 6]
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def chat_checkpoint(mixtral_with_tokenizer, tmp_path_factory) -> Path:
    """The tokenizer checkpoint (EOS 3) with a chat template in its tokenizer_config.json."""
    path = tmp_path_factory.mktemp("chat") / "mixtral-chat"
    shutil.copytree(mixtral_with_tokenizer, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": CHAT_TEMPLATE})
    )
    return path


def chat(custom_id: str, content: str, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": messages, **body}}  # fmt: skip


def completion(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, **body}}  # fmt: skip


def write(path: Path, lines) -> Path:
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def run(run_cli, checkpoint, prompts, *extra):
    status, out, err = run_cli("run", "--checkpoint", checkpoint, "--prompts", prompts,
                               "--quiet", *extra)  # fmt: skip
    assert status == 0, err
    return [json.loads(line) for line in out.splitlines()]


def theirs(checkpoint, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens for one rendered prompt, to its EOS (3) or max_new."""
    tokens, _ = reference_generate(reference_model(checkpoint), [ids], max_new)
    row = tokens[0]
    return row[: row.index(3) + 1] if 3 in row else row


def test_chat_and_completion_requests_answer_as_transformers_does(
    run_cli, tmp_path, chat_checkpoint
):
    """Chat messages rendered by the checkpoint's template with the generation prompt, text and
    token-id completions, each with its own max_tokens, in OpenAI's batch output, in input
    order, with no --gen-len: each answer is transformers' generate of the same prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_checkpoint)
    requests = [
        chat("a", "w5 w6 w7", max_tokens=7),
        completion("b", "w9 w8 w40 w41", max_tokens=3),
        chat("c", "w11", max_completion_tokens=12),
        completion("d", [17, 18, 19, 20, 21], max_tokens=1),
    ]
    lines = run(run_cli, chat_checkpoint, write(tmp_path / "batch.jsonl", requests))
    assert [line["custom_id"] for line in lines] == ["a", "b", "c", "d"]
    rendered = {"a": [1, 5, 6, 7, 2, 3], "b": [9, 8, 40, 41], "c": [1, 11, 2, 3],
                "d": [17, 18, 19, 20, 21]}  # fmt: skip
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    rendered_by_them = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered_by_them["input_ids"] == rendered["a"]
    for line, request in zip(lines, requests, strict=True):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        ids = rendered[line["custom_id"]]
        limit = request["body"].get("max_tokens") or request["body"]["max_completion_tokens"]
        expected = theirs(chat_checkpoint, ids, limit)
        text = tok.decode(expected, skip_special_tokens=True)
        (choice,) = body["choices"]
        if request["url"] == "/v1/chat/completions":
            assert body["object"] == "chat.completion" and body["model"] == "tiny"
            assert choice["message"] == {"role": "assistant", "content": text}
        else:
            assert body["object"] == "text_completion" and choice["text"] == text
        assert choice["finish_reason"] == ("stop" if 3 in expected else "length")
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                                 "total_tokens": len(ids) + len(expected)}  # fmt: skip


def test_stop_strings_end_the_answer_and_are_not_returned(run_cli, tmp_path, chat_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_checkpoint)
    prompt = [17, 18, 19, 20, 21]
    free = theirs(chat_checkpoint, prompt, 12)
    assert len(free) >= 5, "the free run ends too soon to hold a stop string"
    stop = tok.decode(free[2:4])  # two words in the middle of the free answer
    # the answer ends at the first step whose text holds the stop string, cut before it
    steps = next(k for k in range(1, len(free) + 1) if stop in tok.decode(free[:k]))
    text = tok.decode(free[:steps])
    requests = [completion("s", prompt, max_tokens=12, stop=[stop, "w255 w255 w255"])]
    (line,) = run(run_cli, chat_checkpoint, write(tmp_path / "stop.jsonl", requests))
    (choice,) = line["response"]["body"]["choices"]
    assert choice["text"] == text[: text.index(stop)] and stop not in choice["text"]
    assert choice["finish_reason"] == "stop"
    assert line["response"]["body"]["usage"]["completion_tokens"] == steps


def test_a_seeded_sampled_request_repeats_in_any_batch(run_cli, tmp_path, chat_checkpoint):
    """Its draws come from its own seed: the same answer alone, or behind other requests."""
    sampled = completion("x", "w9 w8 w7", max_tokens=10, temperature=1.3, top_p=0.9, seed=42)
    alone = run(run_cli, chat_checkpoint, write(tmp_path / "a.jsonl", [sampled]))
    others = [completion(f"o{i}", f"w{20 + i} w{30 + i}", max_tokens=4) for i in range(3)]
    crowded = run(run_cli, chat_checkpoint, write(tmp_path / "b.jsonl", [*others, sampled]))
    other_seed = dict(sampled, body=dict(sampled["body"], seed=43))
    different = run(run_cli, chat_checkpoint, write(tmp_path / "c.jsonl", [other_seed]))

    def text(lines):
        return lines[-1]["response"]["body"]["choices"][0]["text"]

    assert text(alone) == text(crowded) != text(different)


def test_plain_lines_say_why_they_stopped_and_count_their_tokens(run_cli, tmp_path, checkpoints):
    prompts = ragged_prompts((4, 9, 2), seed=7)
    path = write(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts])
    lines = run(run_cli, checkpoints["mixtral-single"], path, "--gen-len", "5")
    for line, p in zip(lines, prompts, strict=True):
        assert line["finish_reason"] == "length" and line["completion_tokens"] == 5
        assert line["prompt_tokens"] == len(p) and len(line["output_token_ids"]) == 5


@pytest.mark.parametrize(("schedule", "attn", "rc"), SCHEDULES)
def test_finished_sequences_leave_the_batch_in_every_schedule(
    checkpoints, monkeypatch, schedule, attn, rc
):
    """Each sequence with its own length: the tokens of the same prompts run to the longest, cut
    at each one's length, and the steps compute only the sequences still going (the LM head
    runs once per sequence a step)."""
    lengths = (5, 9, 3, 7, 6, 2, 8)
    max_new = (6, 1, 3, 6, 2, 5, 4)
    prompts = ragged_prompts(lengths, seed=3)
    checkpoint = open_checkpoint(checkpoints["qwen3_moe"], "float32")
    full = generate(MoEModel(checkpoint), prompts, 6).output_token_ids
    rows = []
    logits = MoEModel.logits
    monkeypatch.setattr(
        MoEModel, "logits", lambda self, h, *a: (rows.append(h.shape[0]), logits(self, h, *a))[1]
    )
    runtime = placed_runtime(checkpoint, policy(attn=attn, rc=rc), schedule, CPU)
    try:
        gen = generate(runtime, prompts, 6, limits=[Limits(max_new=n) for n in max_new])
    finally:
        runtime.close()
    assert gen.output_token_ids == [row[:n] for row, n in zip(full, max_new, strict=True)]
    assert gen.finish_reasons == ["length"] * len(prompts)
    decode_rows = sum(n - 1 for n in max_new)
    assert gen.decode_rows == decode_rows
    assert sum(rows) == len(prompts) + decode_rows


def test_per_sequence_sampling_does_not_depend_on_the_batch(checkpoints):
    model = MoEModel(open_checkpoint(checkpoints["mixtral-single"], "float32"))
    prompts = ragged_prompts((4, 6, 3), seed=2)
    warm = Sampling(temperature=1.2, top_p=0.9, seed=5)
    limits = [Limits(max_new=6), Limits(max_new=6, sampling=warm), Limits(max_new=2)]
    together = generate(model, prompts, 6, limits=limits).output_token_ids
    alone = generate(model, prompts[1:2], 6, limits=limits[1:2]).output_token_ids
    assert together[1] == alone[0]


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["{not json"], "batch.jsonl:1: not a JSON object"),
        ([completion("a", "w5", max_tokens=2), {**completion("b", "w6"), "url": "/v1/embeddings"}],
         "batch.jsonl:2: url '/v1/embeddings' is not supported"),
        ([{**completion("a", "w5", max_tokens=2), "method": "GET"}], "method 'GET'"),
        ([completion("a", "w5", max_tokens=0)], "batch.jsonl:1: body.max_tokens must be"),
        ([completion("a", "w5", max_tokens=600)], "batch.jsonl:1: a prompt of 1 tokens plus 600"),
        ([completion("a", "w5", max_tokens=2), completion("a", "w6", max_tokens=2)],
         "batch.jsonl:2: custom_id 'a' repeats line 1's"),
        ([completion("a", "w5", max_tokens=2), {"prompt_token_ids": [5]}],
         "batch.jsonl:2: a plain line in a file of OpenAI batch lines"),
        ([completion("a", "w5", max_tokens=2, n=2)], "batch.jsonl:1: body.n 2 is not supported"),
        ([completion("a", "w5", max_tokens=2, logprobs=True)], "body.logprobs true"),
        ([chat("a", "w5", max_tokens=2, tools=[{"type": "function"}])], "body.tools is not"),
        ([chat("a", "w5", max_tokens=2, response_format={"type": "json_object"})],
         "body.response_format is not supported"),
        ([completion("a", "w5")], "batch.jsonl:1: no max_tokens, and no --gen-len"),
        ([chat("a", "w5", max_tokens=2)], "batch.jsonl:1: chat messages, but"),
    ],
)  # fmt: skip
def test_a_bad_request_is_refused_before_loading(run_cli, tmp_path, mixtral_with_tokenizer,
                                                 lines, fragment):  # fmt: skip
    """One line naming the line and what is wrong, exit 2, nothing written; the tokenizer
    checkpoint has no chat template (the last case)."""
    out = tmp_path / "out.jsonl"
    path = write(tmp_path / "batch.jsonl", lines)
    status, _, err = run_cli("run", "--checkpoint", mixtral_with_tokenizer, "--prompts", path,
                             "--output", out, "--quiet")  # fmt: skip
    assert_one_line_error(status, err, fragment)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_chat_without_a_tokenizer_is_refused(run_cli, tmp_path, checkpoints):
    path = write(tmp_path / "batch.jsonl", [chat("a", "w5", max_tokens=2)])
    status, _, err = run_cli("run", "--checkpoint", checkpoints["mixtral-single"], "--prompts",
                             path, "--quiet")  # fmt: skip
    assert_one_line_error(status, err, "batch.jsonl:1: chat messages, but", "has no tokenizer")


def test_the_runs_prediction_takes_each_requests_length(run_cli, tmp_path, checkpoints):
    """--hardware predicts the batch with each request's own length: the tokens it predicts are
    the tokens the run generates, and the record's workload says the lengths."""
    requests = [completion(f"r{i}", [5 + i, 6, 7], max_tokens=n) for i, n in enumerate((2, 6, 3))]
    status, out, err = run_cli("run", "--checkpoint", checkpoints["mixtral-single"], "--prompts",
                               write(tmp_path / "b.jsonl", requests), "--hardware", "ci-cpu",
                               "--quiet", *record_flags())  # fmt: skip
    assert status == 0, err
    record = json.loads(out)
    assert record["workload"]["gen_len"] == 6
    assert record["workload"]["gen_lens"] == [[2, 1], [3, 1], [6, 1]]
    assert record["predicted"]["generated_tokens"] == record["measured"]["generated_tokens"] == 11


def test_the_python_api_is_hrm_run(run_cli, tmp_path, chat_checkpoint, checkpoints):
    """hrm.api.generate answers as `hrm run` does, for text, ids and chat requests with their own
    limits, resident and under a plan; its errors are the command's, as HrmError."""
    from hrm.api import generate as hrm_generate
    from hrm.errors import HrmError

    requests = [
        "w9 w8 w7",
        [17, 18, 19],
        {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3},
        {"prompt": "w40 w41", "max_tokens": 8, "temperature": 1.1, "seed": 4, "stop": "w3"},
    ]
    results = hrm_generate(chat_checkpoint, requests, gen_len=6)
    plain = [{"prompt": "w9 w8 w7"}, {"prompt_token_ids": [17, 18, 19]}]
    cli = run(run_cli, chat_checkpoint, write(tmp_path / "p.jsonl", plain), "--gen-len", "6")
    assert [r.output_token_ids for r in results[:2]] == [line["output_token_ids"] for line in cli]
    assert results[2].prompt_tokens == 5 and results[2].completion_tokens <= 3
    assert results[3].finish_reason in ("stop", "length") and "w3" not in (results[3].text or "")
    assert results[3] == hrm_generate(chat_checkpoint, requests[3:], gen_len=6)[0]  # its seed
    plan = tmp_path / "plan.json"
    policy = "N=2,mu=1,attn=cpu,ffn=gpu,w=0,kv=0"
    status, _, err = run_cli("plan", "--model", checkpoints["mixtral-single"], "--hardware", "l4",
                             "--prompt-len", "3", "--gen-len", "6", "--dtype", "float32",
                             "--policy", policy, "-o", plan)  # fmt: skip
    assert status == 0, err
    ids = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    planned = hrm_generate(checkpoints["mixtral-single"], ids, gen_len=4, plan=plan)
    resident = hrm_generate(checkpoints["mixtral-single"], ids, gen_len=4)
    assert planned == resident and all(r.text is None for r in planned)
    with pytest.raises(HrmError, match=r"requests\[1\]: give exactly one of prompt"):
        hrm_generate(chat_checkpoint, ["w5", {"max_tokens": 3}], gen_len=4)
    with pytest.raises(HrmError, match=r"requests\[0\]: no max_tokens, and no --gen-len"):
        hrm_generate(chat_checkpoint, ["w5"])
