"""A checkpoint's files: tensor names across its safetensors shards, each read as a view of the
mapped file or decoded into the run's dtype (executor/stored_formats.py), checked against the
shapes config.json implies. executor/checkpoint.py reads each family's layers through it."""

from __future__ import annotations

from pathlib import Path

import torch

from executor.safetensors_mmap import SafetensorsFile
from executor.stored_formats import FP8_SCALES, MXFP4_BLOCK, decode_fp8_blocks, decode_mxfp4
from hrm.errors import HrmError
from hrm.io import load_json


class Tensors:
    """Name -> tensor across the shards, checked against the shapes config.json implies."""

    def __init__(
        self, directory: Path, dtype: torch.dtype, device: str, fp8_block=None, shards=None
    ):
        """fp8_block: the checkpoint's FP8 block (bo, bi), when it stores weights so; shards: its
        files, each a SafetensorsFile or its duck type (a GGUF file's: executor/gguf_tensors.py),
        else the directory's safetensors."""
        self.directory = directory
        shards = open_shards(directory) if shards is None else shards
        self.where = {name: f for f in shards for name in f.keys()}
        self.dtype = dtype
        self.device = torch.device(device)
        self.fp8_block = fp8_block

    def has(self, name: str) -> bool:
        return name in self.where

    def release(self, name: str) -> None:
        """Drop the file pages of a tensor that was copied out (a strided view made contiguous)."""
        self.where[name].release(name)

    def _fp8(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """An FP8 weight decoded with its block scales (executor/stored_formats.py)."""
        scales = name + FP8_SCALES
        if self.fp8_block is None or not self.has(scales):
            raise HrmError(
                f"{self.directory}: tensor {scales} is missing; the FP8 weight {name} cannot "
                "be decoded without its block scales (config.json's quantization_config names "
                "the block)"
            )
        scale_inv = self.where[scales].tensor(scales)
        decoded = decode_fp8_blocks(weight, scale_inv, self.fp8_block, self.dtype).to(self.device)
        self.release(name)
        self.release(scales)
        return decoded

    def mxfp4(self, prefix: str, shape: tuple[int, int, int]):
        """MXFP4 `prefix`_blocks and _scales of a weight [E, out, in]: a function of e giving
        expert e's [out, in] in the run's dtype (decoded one expert at a time: executor/
        stored_formats.py)."""
        E, out, inp = shape
        groups = inp // MXFP4_BLOCK
        blocks = self.get(prefix + "_blocks", (E, out, groups, MXFP4_BLOCK // 2), as_stored=True)
        if not self.has(prefix + "_scales"):
            raise HrmError(
                f"{self.directory}: tensor {prefix}_scales is missing; the MXFP4 blocks "
                f"{prefix}_blocks cannot be decoded without their scales"
            )
        scales = self.get(prefix + "_scales", (E, out, groups), as_stored=True)
        return lambda e: decode_mxfp4(blocks[e], scales[e], self.dtype).to(self.device)

    def get(self, name: str, shape: tuple[int, ...], as_stored: bool = False) -> torch.Tensor:
        """The tensor in the run's dtype (as_stored: in the file's, MXFP4 blocks and scales): a
        view of the file, its pages read in now, or one copy when the dtype differs."""
        f = self.where.get(name)
        if f is None:
            raise HrmError(
                f"{self.directory}: tensor {name} is missing from the checkpoint; "
                "it is incomplete or not a supported layout"
            )
        if f.shape(name) != shape:
            raise HrmError(
                f"{f.path}: tensor {name} has shape {list(f.shape(name))} but config.json implies "
                f"{list(shape)}; the checkpoint does not match its config.json"
            )
        tensor = f.tensor(name)
        if as_stored:
            return tensor
        if tensor.dtype == torch.float8_e4m3fn:
            return self._fp8(name, tensor)
        if tensor.dtype == self.dtype and self.device.type == "cpu":
            f.populate(name)
            return tensor
        converted = tensor.to(device=self.device, dtype=self.dtype)
        f.release(name)
        return converted


def open_shards(directory: Path) -> list[SafetensorsFile]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = load_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HrmError(f"{index_path}: field 'weight_map' is missing or empty; fix the index")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (directory / name).is_file():
                raise HrmError(
                    f"{directory / name}: shard named in {index_path.name} is missing; "
                    "re-download the checkpoint"
                )
        return [SafetensorsFile(directory / name) for name in names]
    single = directory / "model.safetensors"
    if single.is_file():
        return [SafetensorsFile(single)]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise HrmError(
            f"{directory}: no .safetensors files (only safetensors checkpoints are read)"
        )
    return [SafetensorsFile(p) for p in found]
