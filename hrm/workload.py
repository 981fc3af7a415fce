"""Workload: the prompts and generation length a batch job runs.

The cost model charges prefill on the prompt lengths (all padded to the maximum when `padding`)
and every decode step on the context it really has (reference, section 2 notes the paper's
artifact charges the maximum context on every step; we do not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hrm.errors import HrmError
from hrm.schema import check_keys, dataclass_keys, positive_int


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompt_len_mean: float
    prompt_len_max: int
    gen_len: int
    padding: bool = False

    def __post_init__(self) -> None:
        positive_int(self.gen_len, where="gen_len")
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
        cls, prompt_lens: list[int], gen_len: int, padding: bool = False
    ) -> Workload:
        if not prompt_lens:
            raise HrmError("workload: no prompts")
        return cls(
            prompt_len_mean=sum(prompt_lens) / len(prompt_lens),
            prompt_len_max=max(prompt_lens),
            gen_len=gen_len,
            padding=padding,
        )

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
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "workload") -> Workload:
        required, optional = dataclass_keys(cls)
        data = check_keys(data, where=where, required=required, optional=optional)
        return cls(**data)
