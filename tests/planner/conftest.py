"""Fixtures: the tiny model and machines of tiny_setup.py."""

from __future__ import annotations

import pytest
from tiny_setup import cpu_only_profile, gpu_profile, tiny_arch

from hrm.arch import ModelArch
from hrm.workload import Workload


@pytest.fixture
def arch() -> ModelArch:
    return tiny_arch()


@pytest.fixture
def make_gpu_profile():
    return gpu_profile


@pytest.fixture
def make_cpu_profile():
    return cpu_only_profile


@pytest.fixture
def workload() -> Workload:
    return Workload(prompt_len_mean=16, prompt_len_max=32, gen_len=4)
