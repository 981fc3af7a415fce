"""One engine of bench_cpu_peers.py, kept loaded in its own process and driven over stdin.

    python bench/peer_workers.py ENGINE CHECKPOINT THREADS

ENGINE is hrm (the executor's resident run, its CPU GEMM path chosen as `hrm run` chooses it),
transformers (generate, greedy) or vllm (vLLM's CPU backend, run by the Python of a venv that
holds it: this file imports nothing of hrm for that engine). Each line on stdin is a JSON job,
{"prompts": [[ids...], ...], "gen_len": G}; each answer is one JSON line on stdout, {"seconds":
prefill + decode wall time, "generated": tokens, "first": the first sequence's first tokens}.
The engine is warmed up before the first job; whatever it prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hrm_engine(checkpoint: str, cpu_moe: str = "loop"):
    sys.path.insert(0, str(ROOT))
    from executor.checkpoint import open_checkpoint
    from executor.generate import generate
    from executor.model import MoEModel
    from hrm.profiling.host_gemm import cpu_gemm_for_run

    opened = open_checkpoint(checkpoint, "bfloat16")
    choice = cpu_gemm_for_run(opened.arch, "bfloat16", mode="auto", hardware=None,
                              weights=opened.expert_gate_weights, warn=lambda m: None)  # fmt: skip
    print(f"hrm: {choice.describe()}", file=sys.stderr)
    model = MoEModel(opened, choice, take_over=True, cpu_moe=cpu_moe)

    def run(prompts, gen_len):
        return generate(model, prompts, gen_len).output_token_ids

    return run


def transformers_engine(checkpoint: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()

    def run(prompts, gen_len):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                max_new_tokens=gen_len, min_new_tokens=gen_len,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    return run


def vllm_engine(checkpoint: str):
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
              enforce_eager=True, seed=0)  # fmt: skip

    def run(prompts, gen_len):
        params = SamplingParams(max_tokens=gen_len, ignore_eos=True, temperature=0,
                                detokenize=False)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


ENGINES = {
    "hrm": hrm_engine,
    # its routed experts' GEMMs one native call each (executor/fused_moe.py, --cpu-moe fused)
    "hrm-fused": lambda checkpoint: hrm_engine(checkpoint, "fused"),
    "transformers": transformers_engine,
    "vllm": vllm_engine,
}


def main() -> None:
    engine, checkpoint, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    answers = os.fdopen(os.dup(1), "w")  # the answers' own line: an engine's logs go to stderr
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(threads)
    run = ENGINES[engine](checkpoint)
    run([[1, 2, 3, 4]] * 2, 2)  # warm-up
    print(json.dumps({"ready": engine}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        started = time.perf_counter()
        tokens = run(job["prompts"], job["gen_len"])
        seconds = time.perf_counter() - started
        answer = {"seconds": seconds, "generated": sum(map(len, tokens)), "first": tokens[0][:8]}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main()
