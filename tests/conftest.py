"""Shared fixtures: devices to cross test cases with, and float64 by default."""
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
