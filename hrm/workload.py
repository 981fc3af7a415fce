"""Workload: the prompts and generation length a batch job runs.

The cost model charges prefill on the prompt lengths (all padded to the maximum when `padding`)
and every decode step on the context it really has (reference, section 2 notes the paper's
artifact charges the maximum context on every step; we do not). Requests with their own lengths
(max_tokens) give `gen_lens`, a histogram: a sequence leaves its micro-batch when it has its
tokens, so decode step t computes the share of sequences longer than t (`decode_active`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hrm.errors import HrmError
from hrm.schema import check_keys, dataclass_keys, positive_int


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompt_len_mean: float
    prompt_len_max: int
    gen_len: int  # the longest answer
    padding: bool = False
    # (answer length, sequences) where they differ; () when every sequence generates gen_len
    gen_lens: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        positive_int(self.gen_len, where="gen_len")
        lens = tuple(sorted((int(n), int(c)) for n, c in self.gen_lens))
        object.__setattr__(self, "gen_lens", lens)
        if lens and (max(n for n, _ in lens) != self.gen_len or min(n for n, _ in lens) < 1):
            raise HrmError(
                f"gen_lens {list(lens)} must be in [1, gen_len] and reach {self.gen_len}"
            )
        if any(c < 1 for _, c in lens):
            raise HrmError(f"gen_lens {list(lens)}: each length needs a positive count")
        positive_int(self.prompt_len_max, where="prompt_len_max")
        if not self.prompt_len_mean > 0:
            raise HrmError(f"prompt length must be positive, got {self.prompt_len_mean!r}")
        if self.prompt_len_mean > self.prompt_len_max:
            raise HrmError(
                f"mean prompt length {self.prompt_len_mean:g} exceeds the maximum "
                f"{self.prompt_len_max}; raise --max-prompt-len"
            )

    @classmethod
    def from_prompt_lens(
        cls,
        prompt_lens: list[int],
        gen_len: int,
        padding: bool = False,
        answer_lens: Sequence[int] | None = None,
    ) -> Workload:
        """answer_lens: each prompt's own most new tokens (its max_tokens), else gen_len."""
        if not prompt_lens:
            raise HrmError("workload: no prompts")
        counts = Counter(answer_lens or ())
        return cls(
            prompt_len_mean=sum(prompt_lens) / len(prompt_lens),
            prompt_len_max=max(prompt_lens),
            gen_len=max(counts) if counts else gen_len,
            padding=padding,
            gen_lens=tuple(counts.items()) if len(counts) > 1 else (),
        )

    @property
    def gen_len_mean(self) -> float:
        """Tokens a sequence generates, on average."""
        if not self.gen_lens:
            return float(self.gen_len)
        return sum(n * c for n, c in self.gen_lens) / sum(c for _, c in self.gen_lens)

    @property
    def decode_active(self) -> np.ndarray:
        """[gen_len - 1]: the share of sequences decode step t = 1 .. gen_len - 1 computes, those
        whose answer is longer than t."""
        t = np.arange(1, self.gen_len)
        if not self.gen_lens:
            return np.ones(len(t))
        lens = np.array([n for n, _ in self.gen_lens])
        counts = np.array([c for _, c in self.gen_lens], dtype=float)
        return (counts[None, :] * (lens[None, :] > t[:, None])).sum(axis=1) / counts.sum()

    @property
    def prefill_len(self) -> float:
        """Tokens each sequence is charged in prefill: the maximum when padding, else the mean."""
        return float(self.prompt_len_max) if self.padding else self.prompt_len_mean

    @property
    def max_context_len(self) -> int:
        """Longest context any sequence reaches: sizes the KV cache."""
        return self.prompt_len_max + self.gen_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_len_mean": self.prompt_len_mean,
            "prompt_len_max": self.prompt_len_max,
            "gen_len": self.gen_len,
            "padding": self.padding,
            **({"gen_lens": [list(x) for x in self.gen_lens]} if self.gen_lens else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "workload") -> Workload:
        required, optional = dataclass_keys(cls)
        data = check_keys(data, where=where, required=required, optional=optional)
        lens = data.pop("gen_lens", ())
        if not isinstance(lens, list | tuple) or not all(
            isinstance(x, list | tuple) and len(x) == 2 for x in lens
        ):
            raise HrmError(f"{where}: gen_lens must be a list of [length, count] pairs")
        return cls(**data, gen_lens=tuple(tuple(x) for x in lens))
