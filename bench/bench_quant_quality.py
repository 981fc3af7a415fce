"""The quality of the compact weight and KV formats (hrm/formats.py), measured against bfloat16.

For int8 and int4 weights, and an int8 and int4 KV cache (weights in bfloat16), on the
Mixtral-shaped bench model (hidden 1024, width 3584, 4 layers, 8
experts top-2, random weights) and on a tiny checkpoint of each family (made here with
transformers' save_pretrained, as the tests make them): the greedy run in the format against
the same run in bfloat16, same prompts. Reported per model and format:
- the logits' relative error (max |ours - bf16| / max |bf16| per step, over the steps before
  the first token that differs): its maximum and mean;
- the greedy tokens' agreement: the share of generated tokens before each prompt's first
  divergence;
- the bytes per weight achieved over the layers (16-bit norms, routers and ungrouped layers
  included; the embedding and LM head stay 16-bit and are not counted), or per K/V value.
Random weights are harsher than trained ones: their logits are nearly flat, so a small error
flips the greedy choice sooner. For scale, a row per model compares float32 arithmetic on the
same (bfloat16) weights against the bfloat16 run: what bfloat16's own rounding costs. The run
is resident (the format's values dequantized at load), which gives the tokens a paged run of
the format gives (tests/executor/test_quant.py).
Prints a table and writes reports/bench_quant_quality.json.
    python bench/bench_quant_quality.py [--prompts 16 --prompt-len 32 --gen-len 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=32000)  # fmt: skip
FORMATS = ("int8", "int4")
CASES = [("float32 arithmetic", "float32")]
CASES += [("weights", f) for f in FORMATS] + [("kv", f) for f in FORMATS]


def _checkpoints(root: Path):
    """The bench model (random weights in memory) and a tiny checkpoint of each family."""
    from executor.checkpoint import open_checkpoint, random_checkpoint
    from hrm.arch import resolve_model
    from tests.executor import conftest as tiny

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), name="bench", num_layers=4, **BENCH)
    yield "mixtral-bench (random)", random_checkpoint(arch, "bfloat16", seed=0)
    configs = {
        "mixtral": tiny._mixtral_config(),
        "dbrx": tiny._dbrx_config(),
        **{f: tiny._qwen_family_config(f) for f in ("qwen2_moe", "qwen3_moe", "olmoe")},
        "qwen3_moe-dense": tiny._qwen_family_config("qwen3_moe", decoder_sparse_step=2),
    }
    for seed, (name, config) in enumerate(configs.items()):
        path = tiny.save_model(config, root / name, seed=seed)
        yield f"{name} (tiny)", open_checkpoint(path, "bfloat16")


def _greedy(checkpoint, fmt: str | None, prompts, gen_len: int, kv: str | None = None):
    from executor.generate import generate
    from executor.model import MoEModel
    from executor.quant import dequantized_weights
    from hrm.rules.cpu_gemm import CpuGemmChoice

    if fmt == "float32":  # the same weights, computed in float32
        checkpoint = dataclasses.replace(
            checkpoint, weights=_float32(checkpoint.weights), dtype=torch.float32
        )
    elif fmt is not None:
        weights = dequantized_weights(checkpoint.weights, fmt)
        checkpoint = dataclasses.replace(checkpoint, weights=weights)
    dtype = str(checkpoint.dtype).removeprefix("torch.")
    native = CpuGemmChoice(dtype=dtype, buckets=((0.0, "native"),), source="bench")
    model = MoEModel(checkpoint, native, kv_format=kv)
    return generate(model, prompts, gen_len, keep_logits=True)


def _float32(weights):
    """Every tensor of ModelWeights (and of its layers and experts) in float32."""

    def convert(obj):
        if isinstance(obj, torch.Tensor):
            return obj.float()
        if isinstance(obj, tuple):
            return tuple(convert(x) for x in obj)
        if dataclasses.is_dataclass(obj):
            fields = dataclasses.fields(obj)
            return dataclasses.replace(
                obj, **{f.name: convert(getattr(obj, f.name)) for f in fields}
            )
        return obj

    return convert(weights)


def compare(checkpoint, what: str, fmt: str, prompts, gen_len: int, reference) -> dict:
    from hrm.formats import row_bytes
    from hrm.rules.placement import place_model

    if what == "weights":
        ours = _greedy(checkpoint, fmt, prompts, gen_len)
        per_value = 2 * place_model(checkpoint.arch, 0.0, fmt).stored_ratio
    elif fmt == "float32":
        ours, per_value = _greedy(checkpoint, fmt, prompts, gen_len), 2.0
    else:
        ours = _greedy(checkpoint, None, prompts, gen_len, kv=fmt)
        per_value = row_bytes(checkpoint.arch.head_dim, fmt) / checkpoint.arch.head_dim
    agree, errors = [], []
    for i, (a, b) in enumerate(zip(ours.output_token_ids, reference.output_token_ids, strict=True)):
        same = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        agree.append(same / len(b))
        for step in range(min(same + 1, len(b))):  # the step that diverged saw the same context
            x, y = ours.step_logits[step][i].float(), reference.step_logits[step][i].float()
            errors.append(float((x - y).abs().max() / y.abs().max()))
    return {
        "logits_relative_error_max": max(errors),
        "logits_relative_error_mean": sum(errors) / len(errors),
        "greedy_agreement": sum(agree) / len(agree),
        "bytes_per_value": per_value,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("-o", "--output", default=str(ROOT / "reports" / "bench_quant_quality.json"))
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, checkpoint in _checkpoints(Path(root)):
            g = torch.Generator().manual_seed(0)
            vocab = checkpoint.arch.vocab_size
            prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
            prompts = prompts.tolist()
            reference = _greedy(checkpoint, None, prompts, args.gen_len)
            for what, fmt in CASES:
                row = {"model": name, "what": what, "format": fmt}
                row |= compare(checkpoint, what, fmt, prompts, args.gen_len, reference)
                rows.append(row)
                print(
                    f"{name:24s} {what:18s} {fmt:7s} logits rel err max "
                    f"{row['logits_relative_error_max']:.4f} mean "
                    f"{row['logits_relative_error_mean']:.4f}  greedy agreement "
                    f"{row['greedy_agreement']:.2f}  {row['bytes_per_value']:.4f} B/value",
                    flush=True,
                )
    report = {
        "what": "compact weight and KV formats against bfloat16, greedy, resident on the CPU",
        "note": "random weights are harsher than trained ones (flat logits flip sooner)",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
