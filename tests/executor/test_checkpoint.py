"""Loading: zero-copy views of the mapped files, one copy when converting, stop tokens."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor.checkpoint import INIT_STD, open_checkpoint, random_checkpoint, read_arch
from executor.safetensors_mmap import SafetensorsFile
from hrm.errors import HrmError

ROOT = Path(__file__).resolve().parents[2]


def all_tensors(weights):
    tensors = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [layer.attn_norm, layer.wq, layer.wk, layer.wv, layer.wo, layer.ffn_norm]
        tensors += [layer.router] + [t for e in layer.experts for t in (e.w1, e.w2, e.w3)]
    return tensors


def test_same_dtype_weights_are_views_of_the_mapped_file(checkpoints):
    path = checkpoints["dbrx"] / "model.safetensors"
    mapped = SafetensorsFile(path)
    lo = ctypes.addressof(ctypes.c_char.from_buffer(mapped._map))
    hi = lo + path.stat().st_size
    tensor = mapped.tensor("transformer.blocks.1.ffn.experts.mlp.w2")
    assert lo <= tensor.data_ptr() < hi
    for name in ("mixtral-single", "mixtral-fused", "dbrx"):
        ckpt = open_checkpoint(checkpoints[name])
        for t in all_tensors(ckpt.weights):
            assert t.untyped_storage().nbytes() == 0 or not t.untyped_storage().resizable()


def _mapped_bytes(path: Path) -> int:
    """Bytes of `path`'s mappings present in this process's page tables (Rss in smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            ours = len(head) >= 6 and Path(head[5]) == path.resolve()
        elif ours and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


needs_smaps = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="reads the mapping's Rss from /proc/self/smaps"
)


@needs_smaps
@pytest.mark.parametrize("madvise_works", [True, False])
def test_populate_maps_a_views_pages_at_load(tmp_path, monkeypatch, madvise_works):
    """A populated view's pages are read in and mapped at load; an unpopulated one has none
    mapped until first touch, inside whatever timed step reads it first. Without
    MADV_POPULATE_READ (kernels before 5.14) one byte per page is read instead."""
    cold_path, warm_path = tmp_path / "cold.safetensors", tmp_path / "warm.safetensors"
    for path in (cold_path, warm_path):
        save_file({"w": torch.randn(2048, 1024, generator=torch.Generator())}, path)  # 8 MiB
    if not madvise_works:

        def refuse(*args):
            raise OSError(22, "Invalid argument")

        monkeypatch.setattr("executor.safetensors_mmap._populate_read", refuse)
    cold, warm = SafetensorsFile(cold_path), SafetensorsFile(warm_path)
    warm.populate("w")
    assert _mapped_bytes(cold_path) < 2**20
    assert _mapped_bytes(warm_path) >= 8 * 2**20
    del cold, warm


@needs_smaps
def test_a_same_dtype_checkpoint_is_mapped_in_whole_at_load(checkpoints):
    path = checkpoints["dbrx"] / "model.safetensors"
    before = _mapped_bytes(path)  # other tests' checkpoints still mapped, if any
    ckpt = open_checkpoint(checkpoints["dbrx"])
    assert _mapped_bytes(path) - before >= path.stat().st_size - 3 * 4096
    del ckpt


def test_conversion_copies_once_into_the_run_dtype(checkpoints):
    ckpt = open_checkpoint(checkpoints["mixtral-sharded"], "bfloat16")
    assert {t.dtype for t in all_tensors(ckpt.weights)} == {torch.bfloat16}
    exact = open_checkpoint(checkpoints["mixtral-sharded"])
    assert torch.equal(ckpt.weights.lm_head, exact.weights.lm_head.to(torch.bfloat16))


_PEAK_PROBE = """
import sys, torch
from executor.api import peak_rss_bytes
from executor.checkpoint import open_checkpoint
before = peak_rss_bytes()
w = open_checkpoint(sys.argv[1], sys.argv[2]).weights
experts = [t for l in w.layers for e in l.experts for t in vars(e).values() if t is not None]
tensors = [w.embed, w.lm_head] + experts
sum(float(t.sum(dtype=torch.float32)) for t in tensors)
print(int(before), int(peak_rss_bytes()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_holds_one_copy(tmp_path, dtype):
    """A 200 MB fp32 checkpoint loaded as fp32 (views) or bf16 (converted, pages released)."""
    layers, hidden, width, experts = 2, 512, 1024, 24
    config = {
        "model_type": "mixtral",
        "vocab_size": 1000,
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(1000, hidden, generator=g),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(1000, hidden, generator=g),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            tensors[f"{p}self_attn.{n}_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "block_sparse_moe.gate.weight"] = torch.randn(experts, hidden, generator=g)
        for e in range(experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            tensors[x + "w1.weight"] = torch.randn(width, hidden, generator=g)
            tensors[x + "w3.weight"] = torch.randn(width, hidden, generator=g)
            tensors[x + "w2.weight"] = torch.randn(hidden, width, generator=g)
    save_file(tensors, tmp_path / "model.safetensors")
    size = (tmp_path / "model.safetensors").stat().st_size
    result_bytes = size if dtype == "float32" else size / 2
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, str(tmp_path), dtype],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    before, peak = (int(x) for x in out.stdout.split())
    growth = peak - before
    assert growth < 1.15 * result_bytes, f"grew {growth / 1e6:.0f} MB for {size / 1e6:.0f} MB"


def test_stop_tokens_prefer_generation_config(tmp_path, checkpoints):
    src = checkpoints["mixtral-single"]
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    assert read_arch(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert read_arch(tmp_path).eos_token_ids == (7, 9)


def test_the_initialisation_rule_is_transformers_own():
    """init_kind, the rule every random-weight builder follows, read against the weights
    transformers itself initialises (Qwen2-MoE: norms, q/k/v biases, the shared expert's gate):
    norms at one, biases at zero, matrices at its initializer_range (INIT_STD for the bundled
    families)."""
    from transformers import AutoModelForCausalLM

    from executor.checkpoint import INIT_STD, init_kind
    from tests.executor.conftest import _qwen_family_config

    config = _qwen_family_config("qwen2_moe", initializer_range=INIT_STD)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    kinds = set()
    for name, p in model.named_parameters():
        kind = init_kind(name, p.dim())
        kinds.add(kind)
        if kind == "ones":
            assert torch.all(p == 1), name
        elif kind == "zeros":
            assert torch.all(p == 0), name
        elif p.numel() >= 4096:
            assert float(p.detach().std()) == pytest.approx(INIT_STD, rel=0.1), name
    assert kinds == {"ones", "zeros", "normal"}


def test_random_weights_are_initialised_as_transformers_does():
    """--random-weights: norms ones, biases zero, matrices drawn at INIT_STD; sinks only where
    the family has them (a sink of every family's would change its attention)."""
    from hrm.arch import resolve_model

    oss = random_checkpoint(resolve_model("gpt-oss-20b").first_layers(1), "float32")
    layer = oss.weights.layers[0]
    assert torch.equal(layer.attn_norm, torch.ones_like(layer.attn_norm))
    assert not layer.bq.any() and not layer.experts[0].b1.any()
    assert layer.sinks.shape == (64,)
    assert layer.wq.std().item() == pytest.approx(INIT_STD, rel=0.05)
    mixtral = random_checkpoint(resolve_model("mixtral-8x7b").first_layers(1), "bfloat16")
    assert mixtral.weights.layers[0].sinks is None


def test_a_header_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    header = b"[]"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(HrmError, match=r"\(header is not a JSON object\); re-download it"):
        SafetensorsFile(path)
