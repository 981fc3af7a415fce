"""The processes of one run that torchrun started, and the one place that talks to
torch.distributed.

`torchrun --nproc-per-node P [--nnodes M --node-rank i --rdzv-endpoint host:port] -m hrm run ...`
starts P x M processes and sets WORLD_SIZE, RANK, LOCAL_RANK and the rendezvous. World size =
tensor_parallel x data_parallel; ranks g*tp .. g*tp + tp - 1 form data-parallel group g. Group g
runs batches g, g + dp, g + 2 dp, ... of the prompts (executor/batching.py cuts them the same way
in every process), appends them to its own partial file (OUT.jsonl.partial.g), and rank 0 writes
OUT.jsonl once, in input order, from every group's rows, gathered over the process group (so the
nodes need share no filesystem). gloo on a CPU, NCCL on CUDA, each rank on GPU LOCAL_RANK.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from executor.batching import PartialOutput
from hrm.errors import HrmError
from hrm.record import Measurement


@dataclass(frozen=True)
class Share:
    """This process's share of a run: data-parallel group `group` of `groups` runs batches
    group, group + groups, ...; tensor-parallel rank `tp_rank` of `tp` holds that share of every
    layer, `reduce` summing the shares' outputs and `gather` joining their logits."""

    group: int = 0
    groups: int = 1
    tp_rank: int = 0
    tp: int = 1
    reduce: Any = None
    gather: Any = None


@dataclass(frozen=True)
class World:
    size: int = 1
    rank: int = 0
    local_rank: int = 0
    tensor_parallel: int = 1
    tp_group: Any = None  # this rank's tensor-parallel process group (join)
    # all-reduces this rank ran and their seconds: what the record reports per rank
    reduces: dict = field(default_factory=lambda: {"count": 0, "seconds": 0.0}, compare=False)

    @property
    def data_parallel(self) -> int:
        return self.size // self.tensor_parallel

    @property
    def group(self) -> int:
        """This rank's data-parallel group."""
        return self.rank // self.tensor_parallel

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group: which share of the heads it holds."""
        return self.rank % self.tensor_parallel

    @property
    def leads_group(self) -> bool:
        """The first rank of its tensor-parallel group writes the group's partial file."""
        return self.tp_rank == 0

    def share(self) -> Share:
        return Share(self.group, self.data_parallel, self.tp_rank, self.tensor_parallel,
                     self.reducer(), self.gatherer())  # fmt: skip

    def reducer(self):
        """The sum of a tensor over this rank's tensor-parallel group (timed), or None."""
        if self.tensor_parallel == 1:
            return None
        import torch.distributed as dist

        def reduce(t):
            start = time.perf_counter()
            t = t.contiguous()
            dist.all_reduce(t, group=self.tp_group)
            self.reduces["count"] += 1
            self.reduces["seconds"] += time.perf_counter() - start
            return t

        return reduce

    def gatherer(self):
        """Each rank's share of a tensor's last dimension, in rank order, on every rank of the
        tensor-parallel group (the logits of a vocabulary-sharded LM head), or None."""
        if self.tensor_parallel == 1:
            return None
        import torch
        import torch.distributed as dist

        def gather(t):
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(self.tensor_parallel)]
            dist.all_gather(parts, t, group=self.tp_group)
            return torch.cat(parts, dim=-1)

        return gather

    def share_in_group(self, obj):
        """The group's first rank's `obj` on every rank of its tensor-parallel group."""
        if self.tensor_parallel == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.rank - self.tp_rank, group=self.tp_group)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's `obj` at rank 0, in rank order; None on the other ranks."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def agree(self, problem: str | None) -> None:
        """Raise every rank's first problem on every rank (None: this rank has none), so that
        no rank waits for one that stopped."""
        if self.distributed:
            import torch.distributed as dist

            problems: list = [None] * self.size
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise HrmError(problem)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def world_from_env(tensor_parallel: int = 1) -> World:
    """This process's place in the run, from torchrun's environment (none: a world of one)."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    if size % tensor_parallel:
        raise HrmError(
            f"{size} processes do not make groups of the plan's tensor_parallel {tensor_parallel}; "
            f"start a multiple of {tensor_parallel} (torchrun --nproc-per-node)"
        )
    return World(size, int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), tensor_parallel)


def join(world: World, device: str, digest: str) -> World:
    """Open the process group (gloo on a CPU, NCCL on CUDA with this rank on GPU LOCAL_RANK),
    check that every rank runs the same job (the digest of its prompts, plan and settings), and
    make the tensor-parallel groups: `world` with its own."""
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > torch.cuda.device_count():
            raise HrmError(
                f"{local} ranks on this node and {torch.cuda.device_count()} GPUs: start at most "
                "one rank per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    digests: list = [None] * world.size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        dist.destroy_process_group()
        raise HrmError(
            f"rank {other} was started with other prompts, plan or settings than rank 0 (run "
            f"digests {digests[other]} and {digests[0]}); start every rank with the same arguments"
        )
    tp, mine = world.tensor_parallel, None
    if tp > 1:
        for g in range(world.data_parallel):  # every rank makes every group, in one order
            group = dist.new_group(list(range(g * tp, (g + 1) * tp)))
            mine = group if g == world.group else mine
    return dataclasses.replace(world, tp_group=mine)


class FollowerPartial:
    """A tensor-parallel rank's view of its group's partial file: the prompts the group's first
    rank found done there (it runs the rest with it, and writes nothing)."""

    path = None
    pending = PartialOutput.pending  # the batches not all of whose prompts are done

    def __init__(self, done):
        self.done = dict.fromkeys(done)

    def append(self, indices, rows) -> None:
        pass

    def saved(self) -> int:
        return 0


def combined(results: list, world: World):
    """One RunResult of every data-parallel group's (`results` in rank order, a RunResult each;
    a tensor-parallel group's first rank speaks for it): the job's time is its slowest group's,
    its tokens, link bytes and busy time every group's, and each rank's own figures go in the
    environment."""
    leads = results[:: world.tensor_parallel]
    slowest = max(leads, key=lambda r: r.measured.prefill_s + r.measured.decode_s)
    m = slowest.measured
    total = m.prefill_s + m.decode_s
    busy: dict[str, float] = {}
    for r in leads:
        for q, s in r.environment["busy_s"].items():
            busy[q] = busy.get(q, 0.0) + s
    measured = dataclasses.replace(
        m,
        generated_tokens=sum(r.measured.generated_tokens for r in leads),
        busy_fraction={
            q: s / (world.data_parallel * total) if total else 0.0 for q, s in busy.items()
        },
        link_bytes={  # every rank has its own link
            k: sum(r.measured.link_bytes.get(k, 0.0) for r in results) for k in m.link_bytes
        },
        peak_memory_bytes=_most(r.measured.peak_memory_bytes for r in leads),
    )
    ranks = [_rank_figures(rank, r) for rank, r in enumerate(results)]
    environment = {
        **slowest.environment,
        "world_size": world.size,
        "tensor_parallel": world.tensor_parallel,
        "data_parallel": world.data_parallel,
        "busy_s": busy,
        "batches_run": sum(r.environment["batches_run"] for r in leads),
        "batches_resumed": sum(r.environment["batches_resumed"] for r in leads),
        "ranks": ranks,
    }
    return dataclasses.replace(
        slowest,
        outputs={i: row for r in leads for i, row in r.outputs.items()},
        measured=measured,
        batches=[b for r in leads for b in r.batches],
        groups=[r.batches for r in leads],
        environment=environment,
    )


def _rank_figures(rank: int, r) -> dict:
    m: Measurement = r.measured
    return {
        "rank": rank,
        "prefill_s": m.prefill_s,
        "decode_s": m.decode_s,
        "generated_tokens": m.generated_tokens,
        "busy_s": r.environment["busy_s"],
        "batches_run": r.environment["batches_run"],
        "all_reduces": r.environment.get("all_reduces", 0),
        "all_reduce_s": r.environment.get("all_reduce_s", 0.0),
        # continuous batching: the KV context its pool was booked at (its group's own answers),
        # and its passes
        "kv_context": r.environment.get("kv_context"),
        "passes": r.environment.get("continuous", {}).get("passes"),
    }


def _most(maps) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = max(out.get(k, 0.0), v)
    return out
