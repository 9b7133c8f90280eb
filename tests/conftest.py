"""Shared fixtures: devices to cross test cases with, and float64 by default."""
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def fresh_warnings():
    """mixedad warns once per reason and G; each test starts from a clean slate, whatever ran before."""
    from mixedad import _entry as tangents

    tangents._warned.clear()
    yield
    tangents._warned.clear()
