"""The executor against transformers' generate on the same Mixtral- or Qwen3-MoE-shaped model, on
the CPU.

Both run the same random checkpoint (saved by transformers into a temporary directory), the same
batch of random prompts and the same generation length, greedy, never stopping early; each is
warmed up, then timed `--repeats` times and the median kept.  The host is profiled first (`hrm
profile --quick` at the bench model's own shape) unless `--hardware` names a profile; the
executor takes the CPU GEMM path that profile chooses (hrm.rules.cpu_gemm), and the bound and the
prediction price that same path: the roofline bound at the path's peak
(hrm.roofline.run_time_bound) and the planner's prediction of the run at the path's curves,
which is the bound of every op at max(FLOPs / achieved rate, bytes / bandwidth).  A second part
measures peak resident memory while the executor loads and touches every weight of a ~2 GB
checkpoint, in a fresh process.  Prints a table; the last line is JSON; the same JSON goes to
reports/.

    python bench/bench_cpu_vs_transformers.py [--quick]
        [--family mixtral|qwen3_moe|gpt_oss|deepseek_v2]
        [--hardware PATH] [--repeats N]

`--family qwen3_moe` runs Qwen3-30B-A3B's regime at the same hidden size: 64 experts of 384,
top-8 renormalised, 16 query heads of 128 (q twice the hidden size) over 2 KV heads, q/k norms
per head; Mixtral's is 8 experts of 3584, top-2. `--family gpt_oss` runs gpt-oss's: 32 experts
as wide as the hidden size, top-4, biases, sinks, 16 query heads of 64 over 2 KV heads, every
other layer sliding over 128 keys (the full run's 64 + 128 tokens pass it), YaRN; transformers
runs it with its eager attention (gpt-oss has no SDPA path there). `--family deepseek_v2` runs
DeepSeek-V2-Lite's: its latent attention as released (16 heads, a latent of 512 + 64), 64
experts of 704, top-6, two shared, layer 0 dense.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hrm.rules.cpu_gemm import CpuGemmChoice

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(hidden=1024, width=3584, layers=4, batch=64, prompt_len=64, gen_len=128)
QUICK = dict(hidden=1024, width=3584, layers=2, batch=16, prompt_len=32, gen_len=16)
LOAD_CHECK_LAYERS = 11  # hidden 1024, width 3584, 8 experts: about 2.1 GB in bfloat16


def bench_config(family: str, hidden: int, width: int, layers: int):
    """The bench model of `family` at `hidden` and `layers` (`width`: Mixtral's expert width)."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=32000,
            hidden_size=hidden,
            moe_intermediate_size=hidden * 3 // 8,  # Qwen3-30B-A3B: 768 at hidden 2048
            intermediate_size=hidden * 3,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
        )
    if family == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=hidden,
            num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=64,
            num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            max_position_embeddings=131072, eos_token_id=None, bos_token_id=None, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False},
        )  # fmt: skip
    if family == "deepseek_v2":
        return deepseek_v2_lite_config(hidden, layers)
    return mixtral_config(hidden, width, layers)


def deepseek_v2_lite_config(hidden: int, layers: int):
    """DeepSeek-V2-Lite's attention as released (16 heads, a latent of 512, keys of 128 + 64,
    values of 128, q direct, YaRN with mscale 0.707) at `hidden`, its FFN scaled with it (64
    experts of 1408 * hidden / 2048, top-6, two shared, layer 0 dense)."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=10944 * hidden // 2048,
        moe_intermediate_size=1408 * hidden // 2048, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=163840,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    )  # fmt: skip


def mixtral_config(hidden: int, width: int, layers: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )


def random_prompts(batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 32000, (batch, prompt_len), generator=g).tolist()


def save_checkpoint(config, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def median_time(run, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def profile_host(config_path: Path, output: Path) -> Path:
    """A quick profile of this host at the bench model's expert shape: the rates this run sees."""
    subprocess.run(
        [sys.executable, "-m", "hrm", "profile", "--quick", "--device", "cpu", "--quiet"]
        + ["--model", str(config_path), "-o", str(output)],
        check=True,
        cwd=ROOT,
    )
    return output


def host_cpu_gemm(path: Path, hardware: str, dtype: str):
    """The profile and the GEMM path `hrm run --hardware` would take with it on this host."""
    from executor.checkpoint import open_checkpoint
    from hrm.hardware import resolve_hardware
    from hrm.profiling.host_gemm import cpu_gemm_for_run

    profile = resolve_hardware(hardware)
    checkpoint = open_checkpoint(path, dtype)
    choice = cpu_gemm_for_run(
        checkpoint.arch,
        dtype,
        mode="auto",
        hardware=profile,
        weights=checkpoint.expert_gate_weights,
        warn=print,
    )
    return profile, choice


def host_description() -> str:
    from hrm.profiling.cpu import host_facts

    facts = host_facts()
    return f"{facts.cpu_model}, {facts.cores} cores, {' '.join(facts.matrix_features)}"


def time_executor(path: Path, prompts: list[list[int]], gen_len: int, repeats: int, cpu_gemm,
                  cpu_moe: str = "loop"):  # fmt: skip
    from executor.checkpoint import open_checkpoint
    from executor.generate import generate
    from executor.model import MoEModel

    model = MoEModel(open_checkpoint(path, "bfloat16"), cpu_gemm, cpu_moe=cpu_moe)
    generate(model, prompts[:2], 2)  # warm-up
    outputs = {}

    def run():
        outputs["tokens"] = generate(model, prompts, gen_len).output_token_ids

    median, times = median_time(run, repeats)
    return median, times, outputs["tokens"], model.cpu_gemm  # the choice, as the run took it


def time_transformers(path: Path, prompts: list[list[int]], gen_len: int, repeats: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, **{**kwargs, "attention_mask": None})
        outputs = {}

        def run():
            out = model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kwargs)
            outputs["tokens"] = out[:, ids.shape[1] :].tolist()

        median, times = median_time(run, repeats)
    return median, times, outputs["tokens"]


def model_figures(config_path: Path, profile, cpu_gemm, batch: int, prompt_len: int, gen_len: int):
    """What the model says of this run on the profile's CPU along the chosen GEMM path, as tok/s:
    the roofline bound at the path's peak, and the planner's prediction (`hrm run --hardware`)
    at its curves."""
    from hrm.arch import resolve_model
    from hrm.roofline import run_time_bound
    from hrm.workload import Workload
    from planner import predict_resident_run

    arch = resolve_model(config_path)
    shape = dict(batch=batch, prompt_len=prompt_len, gen_len=gen_len, dtype="bfloat16")
    workload = Workload.from_prompt_lens([prompt_len] * batch, gen_len)
    plan = predict_resident_run(
        arch, profile, workload, batch_size=batch, dtype="bfloat16", cpu_gemm=cpu_gemm
    )
    bound = run_time_bound(arch, profile.cpu, **shape, cpu_gemm=cpu_gemm)
    return {"bound_tok_s": bound.throughput_tok_s, "predicted": plan.predicted.to_dict()}


_LOAD_PROBE = """
import sys, torch
from executor.api import peak_rss_bytes
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
ckpt = open_checkpoint(sys.argv[1], "bfloat16")
w = ckpt.weights
tensors = [w.embed, w.final_norm, w.lm_head]
for layer in w.layers:
    tensors += [layer.attn_norm, layer.wq, layer.wk, layer.wv, layer.wo, layer.ffn_norm]
    tensors += [layer.router] + [t for e in layer.experts for t in (e.w1, e.w2, e.w3)]
touched = sum(float(t.sum(dtype=torch.float32)) for t in tensors)  # read every weight page
generate(MoEModel(ckpt), [[1, 2, 3, 4]], 2)
print(int(peak_rss_bytes()))
"""


def load_peak_rss(workdir: Path) -> dict:
    """Peak RSS of a fresh process that loads a ~2 GB checkpoint and touches all of it."""
    path = save_checkpoint(mixtral_config(1024, 3584, LOAD_CHECK_LAYERS), workdir / "load-check")
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    peak = int(out.stdout.split()[-1])
    return {"checkpoint_bytes": size, "peak_rss_bytes": peak, "peak_rss_ratio": peak / size}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run, under 60 s")
    parser.add_argument("--repeats", type=int, help="timed runs per side (3; 1 with --quick)")
    parser.add_argument(
        "--hardware", help="profile for the GEMM path and the bound (default: profile this host)"
    )
    parser.add_argument("--skip-load-check", action="store_true", help="no 2 GB load check")
    parser.add_argument(
        "--family",
        choices=("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2"),
        default="mixtral",
        help="model family",
    )
    parser.add_argument("--cpu-moe", choices=("loop", "fused", "auto"), default="loop",
                        help="hrm's routed experts (hrm run --cpu-moe; the prediction prices "
                             "what ran, fused by the profile's fused curves) (loop)")  # fmt: skip
    parser.add_argument("--output", help="JSON to write (reports/bench_cpu_vs_transformers.json)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    name = "bench_cpu_vs_transformers" + ("_quick" if args.quick else "")
    name += "" if args.family == "mixtral" else f"_{args.family}"
    name += "" if args.cpu_moe == "loop" else f"_{args.cpu_moe}"
    output = Path(args.output or ROOT / "reports" / f"{name}.json")
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 3)
    batch, prompt_len, gen_len = shape["batch"], shape["prompt_len"], shape["gen_len"]
    prompts = random_prompts(batch, prompt_len)

    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(args.family, shape["hidden"], shape["width"], shape["layers"])
        path = save_checkpoint(config, Path(tmp) / "bench")
        params = sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2
        hardware = args.hardware or str(profile_host(path / "config.json", Path(tmp) / "host.yaml"))
        profile, cpu_gemm = host_cpu_gemm(path, hardware, "bfloat16")
        ex_s, ex_times, ex_tokens, ran = time_executor(path, prompts, gen_len, repeats, cpu_gemm,
                                                       args.cpu_moe)  # fmt: skip
        hf_s, hf_times, hf_tokens = time_transformers(path, prompts, gen_len, repeats)
        model = model_figures(path, profile, ran, batch, prompt_len, gen_len)
        load = None if args.quick or args.skip_load_check else load_peak_rss(Path(tmp))

    tokens = batch * gen_len
    prefixes = [_common_prefix(a, b) for a, b in zip(ex_tokens, hf_tokens, strict=True)]
    result = {
        "model": {
            **shape,
            "family": args.family,
            "params": params,
            "dtype": "bfloat16",
            "cpu_moe": args.cpu_moe,
            "experts": getattr(config, "num_local_experts", None) or config.num_experts,
            "top_k": config.num_experts_per_tok,
        },
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "executor_s": ex_times,
        "transformers_s": hf_times,
        "executor_tok_s": tokens / ex_s,
        "transformers_tok_s": tokens / hf_s,
        "speedup": hf_s / ex_s,
        **model,
        "executor_fraction_of_bound": _ratio(tokens / ex_s, model["bound_tok_s"]),
        "transformers_fraction_of_bound": _ratio(tokens / hf_s, model["bound_tok_s"]),
        "executor_fraction_of_prediction": _ratio(
            tokens / ex_s, model["predicted"]["throughput_tok_s"]
        ),
        # (predicted - measured) / measured, as RunRecord.prediction_error
        "prediction_error": _ratio(model["predicted"]["throughput_tok_s"], tokens / ex_s) - 1,
        # bf16 rounding differs between the two, and a random model's logits are nearly flat,
        # so greedy paths part early; tests/executor holds fp32 to identical tokens.
        "tokens_agreeing_before_first_difference_mean": statistics.mean(prefixes),
        "first_token_agreement": sum(p > 0 for p in prefixes) / batch,
        "load": load,
        "hardware": args.hardware or "this host, profiled quickly at the bench model's shape",
        "host": host_description(),
        "cpu_gemm": ran.to_dict(),  # as the run took it (experts, linears)
    }
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("executor_tok_s", "transformers_tok_s", "speedup", "bound_tok_s", "prediction_error")
    summary = {k: result[k] for k in keys}
    if load:
        summary["load_peak_rss_ratio"] = load["peak_rss_ratio"]
    print(json.dumps(summary))


def format_table(r: dict) -> str:
    m = r["model"]
    rows = [
        f"{m.get('family', 'mixtral')}-shaped, {m['params'] / 1e6:.0f}M params, "
        f"{m['layers']} layers, {m['experts']} experts top-{m['top_k']}, bfloat16; "
        f"batch {m['batch']} x {m['prompt_len']} tokens, generate {m['gen_len']}; "
        f"median of {r['repeats']}, {r['threads']} threads",
        f"host: {r['host']}; profile: {r['hardware']}",
        f"CPU GEMM: {CpuGemmChoice.from_dict(r['cpu_gemm']).describe()}",
        f"{'':<14}{'tok/s':>10}{'of bound':>10}",
        f"{'executor':<14}{r['executor_tok_s']:>10.1f}{_pct(r['executor_fraction_of_bound']):>10}",
        f"{'transformers':<14}{r['transformers_tok_s']:>10.1f}"
        f"{_pct(r['transformers_fraction_of_bound']):>10}",
        f"{'bound':<14}{_num(r['bound_tok_s']):>10}   roofline, at the chosen path's peak",
        f"{'predicted':<14}{_num(r['predicted']['throughput_tok_s']):>10}"
        f"{_pct(r['executor_fraction_of_prediction']):>10}   planner, all on the CPU, at the "
        f"chosen path's curves (the executor at this share of it)",
        f"speedup {r['speedup']:.2f}x; same first token in "
        f"{100 * r['first_token_agreement']:.0f}% of sequences, paths part after "
        f"{r['tokens_agreeing_before_first_difference_mean']:.1f} tokens on average (bf16)",
    ]
    if r["load"]:
        load = r["load"]
        rows.append(
            f"load {load['checkpoint_bytes'] / 1e9:.2f} GB checkpoint: peak RSS "
            f"{load['peak_rss_bytes'] / 1e9:.2f} GB ({load['peak_rss_ratio']:.2f}x)"
        )
    return "\n".join(rows)


def _common_prefix(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def _ratio(x, y) -> float | None:
    return x / y if y else None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x) -> str:
    return "null" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    main()
