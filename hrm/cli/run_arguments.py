"""`hrm run`'s arguments for its prompts and for how it runs (hrm/cli/run.py parses them)."""

from __future__ import annotations

from hrm.policy import RUN_DTYPES


def add_prompt_arguments(p) -> None:
    """The prompts: a file, or random ones of a length."""
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompts",
        help='JSONL: {"prompt_token_ids": [...]} or {"prompt": "text"} per line, or OpenAI batch '
        "requests (/v1/chat/completions, /v1/completions)",
    )
    prompts.add_argument("--prompt-len", type=int, help="random prompts of this many tokens")
    p.add_argument("--batch", type=int, help="number of random prompts (with --prompt-len)")
    p.add_argument("--seed", type=int, default=0, help="seed of random prompts and sampling (0)")
    p.add_argument(
        "--gen-len",
        type=int,
        help="tokens to generate per prompt: the default, and the cap, of a request's max_tokens "
        "(default: the largest max_tokens in --prompts)",
    )


def add_run_arguments(p, batchings: tuple[str, ...]) -> None:
    """How the run runs: device, dtypes, sampling, CPU paths, batching, output."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    p.add_argument(
        "--dtype",
        choices=RUN_DTYPES,
        help="weight dtype, or int8 or int4: the weights quantized at load (docs/running.md) "
        "and computed in 16 bits (default: the checkpoint's)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=RUN_DTYPES,
        help="KV cache: int8 or int4 quantizes it in groups along head_dim (default: the dtype "
        "the layers compute in)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="always generate --gen-len tokens per prompt"
    )
    p.add_argument(
        "--hardware",
        help="profile (bundled name or YAML): with a GPU (or --gpu-mem, --schedule) plan for it "
        "and run the best plan; a CPU-only profile adds the prediction of this resident run",
    )
    p.add_argument(
        "--cpu-gemm",
        default="auto",
        help="CPU GEMM path for 16-bit weights: auto (the faster per token count, from the "
        "--hardware profile of this host or a one-second probe), native, widened, or packed "
        "(oneDNN over weights reordered once at load; needs AVX-512) (auto)",
    )
    p.add_argument(
        "--cpu-moe",
        default="auto",
        help="how a CPU run with packed bf16 weights runs its routed experts: loop (one oneDNN "
        "GEMM per expert), fused (each of the experts' two GEMMs one native call over all of "
        "them, compiled on first use; experts of widths a multiple of 64), or auto "
        "(fused where it can run, else the loop). --hardware prices a fused run by the kernel's "
        "curves where hrm profile timed them, else as the loop, and says so (auto)",
    )
    p.add_argument(
        "--batching",
        choices=batchings,
        default="continuous",
        help="continuous: every pass carries the running answers and newly admitted prompts, a "
        "finished request's KV memory goes to the next; static: batches of N, each run to its "
        "longest answer (MoE-Lightning's) (continuous)",
    )
    p.add_argument(
        "--max-tokens-per-pass",
        type=int,
        help="continuous batching: tokens a pass carries at most, decodes and prompt chunks "
        "(default: the plan's, from hrm plan --batching continuous; else the largest: one "
        "micro-batch of the longest prompt beside a decode of each request running)",
    )
    p.add_argument("--threads", type=int, help="CPU threads the run uses (default: torch's)")
    p.add_argument("--disk-dir", metavar="DIR", help="where a plan with weights on disk "
                   "writes its disk tier's file (removed after; default: temp dir)")  # fmt: skip
    p.add_argument("--disk-buffered", action="store_true", help="read the disk tier "
                   "through the page cache where --disk-dir refuses O_DIRECT")  # fmt: skip
    p.add_argument(
        "--output",
        help="JSONL of outputs, one line per prompt in input order (default: stdout, with the "
        "summary on stderr)",
    )
    p.add_argument("--json", action="store_true", help="print the RunRecord as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
