"""GGUF checkpoints: the plan from a file's header equals the plan from its config.json, a run of
a float file reproduces transformers' tokens, a quantized file runs as its dequantized values, a
chat batch runs with the file alone, and bad files are refused in one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from executor.checkpoint import open_checkpoint
from hrm.arch import resolve_model
from tests.conftest import assert_one_line_error
from tests.executor.conftest import _mixtral_config, ragged_prompts, reference_model, save_model
from tests.executor.test_matches_transformers import reference_generate, run_executor
from tests.gguf_files import dequantized_copy, rewrite_gguf, write_gguf

FAMILIES = ("mixtral-single", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
PLAN = ("--hardware", "l4", "--prompt-len", "64", "--gen-len", "32", "--json")


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {name: write_gguf(checkpoints[name], root / f"{name}.gguf") for name in FAMILIES}


def _unnamed(arch):
    return dataclasses.replace(arch, name="-")


@pytest.mark.parametrize("name", FAMILIES)
def test_header_states_the_architecture_of_config_json(checkpoints, gguf_files, name):
    assert _unnamed(resolve_model(gguf_files[name])) == _unnamed(resolve_model(checkpoints[name]))


@pytest.mark.parametrize("name", ("mixtral-single", "qwen3_moe", "deepseek_v3"))
def test_plan_equals_the_plan_from_config_json(run_cli, checkpoints, gguf_files, name):
    status, ours, err = run_cli("plan", "--model", gguf_files[name], *PLAN)
    assert status == 0, err
    _, theirs, _ = run_cli("plan", "--model", checkpoints[name] / "config.json", *PLAN)
    ours, theirs = json.loads(ours), json.loads(theirs)
    assert ours.pop("model") == name
    for plan in (ours, theirs):  # the model's name, and how long the search took
        plan.pop("model", None), plan.pop("search")
    assert ours == theirs


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_equal_the_safetensors_ones(checkpoints, gguf_files, name):
    """Every tensor the model reads, bit for bit: Mixtral's q/k rows unpermuted, DeepSeek's
    kv_b_proj rebuilt from its two halves, experts sliced from their stacks."""
    ours = open_checkpoint(gguf_files[name], "float32").weights
    theirs = open_checkpoint(checkpoints[name], "float32").weights
    pairs = [(ours.embed, theirs.embed), (ours.lm_head, theirs.lm_head)]
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        for layer_a, layer_b in [(a, b), *zip(a.experts, b.experts, strict=True)]:
            for f in dataclasses.fields(layer_a):
                x, y = getattr(layer_a, f.name), getattr(layer_b, f.name)
                if isinstance(y, torch.Tensor):
                    pairs.append((x, y))
    assert all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("name", ("mixtral-single", "deepseek_v3"))
def test_float32_file_gives_transformers_tokens(checkpoints, gguf_files, name):
    prompts = ragged_prompts((5, 9, 3))
    ours = run_executor(gguf_files[name], prompts, steps=8)
    theirs, _ = reference_generate(reference_model(checkpoints[name]), prompts, 8)
    assert ours.output_token_ids == theirs


@pytest.mark.parametrize("kind", ("Q8_0", "Q4_0"))
def test_quantized_file_runs_as_its_dequantized_values(checkpoints, tmp_path, kind):
    quantized = write_gguf(checkpoints["qwen3_moe"], tmp_path / f"q-{kind}.gguf", kind=kind)
    plain = dequantized_copy(quantized, tmp_path / "plain.gguf")
    prompts = ragged_prompts((4, 7))
    ours, theirs = (run_executor(p, prompts, steps=6) for p in (quantized, plain))
    assert ours.output_token_ids == theirs.output_token_ids
    pairs = zip(ours.step_logits, theirs.step_logits, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # and the file is quantized: its values are not the checkpoint's
    reference = open_checkpoint(checkpoints["qwen3_moe"], "float32").weights
    loaded = open_checkpoint(quantized, "float32").weights
    assert not torch.equal(loaded.layers[0].experts[0].w1, reference.layers[0].experts[0].w1)


def test_chat_batch_runs_with_the_gguf_alone(run_cli, tmp_path):
    """The tokenizer and chat template come from the file's metadata: a chat request gives the
    tokens of its rendered prompt given as ids."""
    from executor.gguf_tokenizer import gguf_tokenizer

    # room for byte-pair merges beside the 256 bytes, and an end token
    source = save_model(_mixtral_config(vocab_size=320), tmp_path / "mixtral-320", seed=5)
    path = write_gguf(source, tmp_path / "chat.gguf", tokenizer=True)
    messages = [{"role": "user", "content": "hi there"}]
    requests = tmp_path / "chat.jsonl"
    body = {"model": "chat", "messages": messages, "max_tokens": 4}
    request = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    requests.write_text(json.dumps(request) + "\n")
    tokenizer = gguf_tokenizer(path)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = list(ids["input_ids"])
    by_ids = tmp_path / "ids.jsonl"
    by_ids.write_text(json.dumps({"prompt_token_ids": list(ids), "max_tokens": 4}) + "\n")
    answers = []
    for prompts in (requests, by_ids):
        out = tmp_path / f"{prompts.stem}-answers.jsonl"
        status, _, err = run_cli("run", "--checkpoint", path, "--prompts", prompts, "--output", out)
        assert status == 0, err
        answers.append(json.loads(out.read_text()))
    chat, by_id = answers
    assert len(ids) > len(messages[0]["content"]) // 2  # the template rendered around the text
    assert chat["response"]["body"]["usage"]["prompt_tokens"] == by_id["prompt_tokens"] == len(ids)
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == by_id["text"]
    assert tokenizer.decode(by_id["output_token_ids"]) == by_id["text"]


def test_split_file_plans_and_runs_from_its_first_part(run_cli, checkpoints, tmp_path):
    first = write_gguf(checkpoints["qwen3_moe"], tmp_path / "split.gguf", split_tensors=12)
    assert first.name == "split-00001-of-00004.gguf"
    assert _unnamed(resolve_model(first)) == _unnamed(resolve_model(checkpoints["qwen3_moe"]))
    prompts = ragged_prompts((3, 6))
    ours, theirs = (run_executor(p, prompts, steps=4) for p in (first, checkpoints["qwen3_moe"]))
    assert ours.output_token_ids == theirs.output_token_ids
    later = first.with_name("split-00002-of-00004.gguf")
    status, _, err = run_cli("plan", "--model", later, *PLAN)
    assert_one_line_error(status, err, "split", "00001")
    first.with_name("split-00003-of-00004.gguf").unlink()
    status, _, err = run_cli("plan", "--model", first, *PLAN)
    assert_one_line_error(status, err, "split-00003-of-00004.gguf", "missing")


def _rewritten(src, out, change):
    data = bytearray(src.read_bytes())
    out.write_bytes(change(data))
    return out


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda d: d[: len(d) * 3 // 5], ("truncated",)),
        (lambda d: d[:4] + (99).to_bytes(4, "little") + d[8:], ("version",)),
        (lambda d: b"GGML" + d[4:], ("not a readable GGUF",)),
    ],
    ids=["truncated", "unknown-version", "not-gguf"],
)
def test_broken_file_is_refused_in_one_line(run_cli, gguf_files, tmp_path, change, fragments):
    bad = _rewritten(gguf_files["qwen3_moe"], tmp_path / "bad.gguf", change)
    run = ("run", "--checkpoint", bad, "--prompt-len", "4", "--batch", "1", "--gen-len", "2")
    for command in (("plan", "--model", bad, *PLAN), run):
        status, out, err = run_cli(*command)
        assert_one_line_error(status, err, str(bad), *fragments)
        assert out == ""


def _header_only(path, arch, keys, tensors):
    """A GGUF with the given metadata and tensors (name -> (array, raw type or None))."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_dense_and_unknown_architectures_are_refused(run_cli, tmp_path):
    keys = {"block_count": 1, "embedding_length": 8, "head_count": 2, "feed_forward_length": 16}
    embed = {"token_embd.weight": (np.zeros((32, 8), np.float32), None)}
    dense = _header_only(tmp_path / "dense.gguf", "llama", keys, embed)
    status, out, err = run_cli("plan", "--model", dense, *PLAN)
    assert_one_line_error(status, err, "dense model", "mixtures of experts")
    other = _header_only(tmp_path / "gemma.gguf", "gemma3", keys, embed)
    status, out, err = run_cli("plan", "--model", other, *PLAN)
    assert_one_line_error(status, err, "'gemma3' is not supported", "qwen3moe")


def test_unsupported_tensor_type_is_named(run_cli, checkpoints, tmp_path):
    """A file with an IQ4_NL tensor plans (its header is enough) and is refused for a run."""
    import gguf

    src = write_gguf(checkpoints["qwen3_moe"], tmp_path / "q.gguf")
    iq = gguf.GGMLQuantizationType.IQ4_NL

    def one_iq4(name, shape, t):  # IQ4_NL: 18 bytes a block of 32
        if name == "blk.0.ffn_up_exps.weight":
            return np.zeros((*shape[:-1], shape[-1] // 32 * 18), np.uint8), iq

    path = rewrite_gguf(src, tmp_path / "iq.gguf", one_iq4)
    assert run_cli("plan", "--model", path, *PLAN)[0] == 0
    status, out, err = run_cli("run", "--checkpoint", path, "--prompt-len", "4", "--batch", "1",
                               "--gen-len", "2")  # fmt: skip
    assert_one_line_error(status, err, "blk.0.ffn_up_exps.weight", "IQ4_NL", "Q4_K")
    assert out == ""


def _k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks of 256 values with small finite scales: the f16 d and dmin at the
    head of Q4_K and Q5_K blocks (144 and 176 bytes), d at the tail of Q6_K's (210)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if kind == "Q6_K":
        blocks[..., -2:] = scale
    else:
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ("Q4_K", "Q5_K", "Q6_K"))
def test_k_quant_file_runs_as_its_dequantized_values(tmp_path, kind):
    """llama.cpp's common types (Q4_K_M files hold Q4_K and Q6_K), on a model wide enough for
    their 256-value blocks: every expert matrix random blocks, runs like its dequantized copy."""
    import gguf

    config = _mixtral_config(hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    source = write_gguf(save_model(config, tmp_path / "wide", seed=9), tmp_path / "wide.gguf")
    rng, qtype = np.random.default_rng(0), gguf.GGMLQuantizationType[kind]

    def k_quant(name, shape, t):
        if "_exps" in name:
            blocks = _k_blocks(kind, int(np.prod(shape[:-1])), shape[-1], rng)
            return blocks.reshape(*shape[:-1], -1), qtype

    quantized = rewrite_gguf(source, tmp_path / "k.gguf", k_quant)
    plain = dequantized_copy(quantized, tmp_path / "plain.gguf")
    prompts = ragged_prompts((4, 7))
    ours, theirs = (run_executor(p, prompts, steps=6) for p in (quantized, plain))
    assert ours.output_token_ids == theirs.output_token_ids
    assert all(torch.equal(a, b) for a, b in zip(ours.step_logits, theirs.step_logits, strict=True))
