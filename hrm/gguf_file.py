"""GGUF files (llama.cpp's format) read from their header alone: each tensor's name, shape, type
and place, and the architecture stated as the config.json it was converted from.

The `gguf` package (llama.cpp's own, docs/decisions.md) parses the file; numpy maps it, so no
tensor data is read here; hrm/gguf_config.py turns the metadata into config.json's fields.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hrm.errors import HrmError
from hrm.gguf_config import config_of

# the tensor types a run decodes (the `gguf` package dequantizes the quantized ones)
RUN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
             "Q5_K", "Q6_K", "MXFP4")  # fmt: skip
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor as the header places it: shape in torch's order ([..., out, in])."""

    name: str
    shape: tuple[int, ...]
    kind: str  # its GGML type's name: F32, BF16, Q4_K ...
    path: Path
    offset: int  # of its data in the file
    nbytes: int


@dataclass(frozen=True)
class GgufModel:
    path: Path  # the file, or a split file's first part
    architecture: str
    metadata: dict[str, Any]  # scalars and short arrays (tokenizer lists left out)
    tensors: dict[str, GgufTensor]
    config: dict[str, Any]  # config.json's fields, as far as the file states them
    parts: tuple = ()  # (file, (mtime, size)) of each part as it was read

    def described(self) -> tuple[dict[str, Any], str, str]:
        """ModelArch.from_hf_config's arguments: the config, the model's name, where it is."""
        return self.config, self.path.name.removesuffix(".gguf"), str(self.path)


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise HrmError(
            f"{path}: not a readable GGUF file ({exc}); it may be truncated, or of a GGUF "
            "version this gguf package does not read (versions 2 and 3)"
        ) from None


def _metadata(reader) -> dict[str, Any]:
    """Every key's value, arrays of up to 64 items as lists; longer ones (the vocabulary) as
    their length, read where needed (hrm.gguf_file.token_count)."""
    import numpy as np
    from gguf import GGUFValueType

    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if len(field.types) > 1 and len(field.data) > 64:  # an array
            out[name] = len(field.data)
        elif field.types == [GGUFValueType.FLOAT32]:  # 1e-05, not 9.999999747378752e-06
            out[name] = float(str(np.float32(field.contents())))
        else:
            out[name] = field.contents()
    return out


def _parts(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """A split file's parts (llama.cpp's NAME-0000k-of-0000n.gguf), from its first."""
    count = int(metadata.get("split.count", 1) or 1)
    if count == 1:
        return [path]
    match = _SPLIT.match(path.name)
    if match is None or int(match["no"]) != 1:
        raise HrmError(
            f"{path}: a part of a split GGUF ({count} parts); give its first part, "
            "NAME-00001-of-NNNNN.gguf"
        )
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]  # fmt: skip
    for p in parts:
        if not p.is_file():
            raise HrmError(f"{p}: part of the split GGUF {path.name} is missing")
    return parts


def _tensors(reader, path: Path) -> dict[str, GgufTensor]:
    out = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > reader.data.size:
            raise HrmError(
                f"{path}: tensor {t.name} ends at byte {end} past the file's "
                f"{reader.data.size}; the file is truncated, download it again"
            )
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        out[t.name] = GgufTensor(name=t.name, shape=shape, kind=t.tensor_type.name, path=path,
                                 offset=int(t.data_offset), nbytes=int(t.n_bytes))  # fmt: skip
    return out


def read_gguf(path: str | os.PathLike) -> GgufModel:
    """The header of a GGUF file (all parts of a split one): its tensors and its config. Read
    once per file as its parts stand (a run asks for it to plan, to load and for its
    tokenizer): read again when any part changed or went."""
    path = Path(path)
    if not path.is_file():
        raise HrmError(f"{path}: no such GGUF file; check the path")
    model = _read_gguf(path, _state(path))
    if any(_state(p) != state for p, state in model.parts):
        _read_gguf.cache_clear()
        model = _read_gguf(path, _state(path))
    return model


def _state(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of a file, None when it is not there."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _read_gguf(path: Path, state: tuple[int, int] | None) -> GgufModel:
    """read_gguf's work, cached by the first part's path and state."""
    reader = _reader(path)
    metadata = _metadata(reader)
    tensors = _tensors(reader, path)
    parts = _parts(path, metadata)
    for part in parts[1:]:
        tensors.update(_tensors(_reader(part), part))
    architecture = metadata.get("general.architecture")
    config = config_of(architecture, metadata, tensors, str(path))
    return GgufModel(path=path, architecture=architecture, metadata=metadata, tensors=tensors,
                     config=config, parts=tuple((p, _state(p)) for p in parts))  # fmt: skip
