"""The exact byte counter and the peak_memory front door, against answers known by hand."""
import pytest
import torch

from mixedad.profiling import StorageCounter, cpu_peak_memory, cuda_peak_memory, median_time, peak_memory
from tests.conftest import requires_cuda

N = 1000
NBYTES = N * 8  # float64


def test_single_allocation_counted_exactly():
    result, peak = peak_memory(lambda: torch.empty(N, dtype=torch.float64))
    assert peak == NBYTES and result.shape == (N,)


def test_freed_temporaries_give_max_not_sum():
    def chain(x):
        for _ in range(10):
            x = x * 2  # old and new alive together at each step, then the old one is freed
        return x

    x = torch.ones(N, dtype=torch.float64)
    _, peak = peak_memory(chain, x)
    assert peak == 2 * NBYTES


def test_views_inplace_and_preexisting_storages_not_counted():
    x = torch.ones(10, N, dtype=torch.float64)

    def aliasing(x):
        a = x.view(N, 10)
        x.add_(1.0)
        b = x[3]
        c = x.t().transpose(0, 1)
        return a, b, c

    _, peak = peak_memory(aliasing, x)
    assert peak == 0


def test_saved_for_backward_storages_stay_counted_until_graph_freed():
    w = torch.randn(N, dtype=torch.float64, requires_grad=True)
    with StorageCounter() as counter:
        out = w.exp().sum()  # exp's output is saved for backward; only the graph holds it
        alive_with_graph = counter.current
        del out
        alive_after = counter.current
    assert alive_with_graph == NBYTES + 8  # exp output + the scalar
    assert alive_after == 0
    assert counter.peak == NBYTES + 8


def test_backward_allocations_counted():
    w = torch.randn(N, dtype=torch.float64, requires_grad=True)
    loss = (w * w).sum()
    with StorageCounter() as counter:
        (grad,) = torch.autograd.grad(loss, w)
    assert counter.current == NBYTES  # the returned gradient
    assert counter.peak >= NBYTES


def test_meta_tensors_not_counted():
    _, peak = cpu_peak_memory(lambda: torch.empty(10**9, device="meta"))
    assert peak == 0


def test_counter_leaves_nothing_behind():
    counter = StorageCounter()
    with counter:
        keep = torch.empty(N, dtype=torch.float64)
    assert counter.current == NBYTES and not counter._live
    del keep  # no finalizer runs after the block
    assert counter.current == NBYTES


def test_kwargs_are_passed_through():
    result, peak = peak_memory(torch.zeros, 4, dtype=torch.float64)
    assert result.dtype == torch.float64 and peak == 32


def test_median_time_runs_warmup_plus_repeats():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and seconds >= 0.0
    with pytest.raises(ValueError, match=r"median_time\(fn\): expected repeats >= 1, got 0"):
        median_time(lambda: None, repeats=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_peak_memory_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        cuda_peak_memory(lambda: None)


@requires_cuda
def test_cuda_allocator_peak():
    x = torch.ones(N, dtype=torch.float64, device="cuda")
    result, peak = peak_memory(lambda x: x * 2, x)
    assert result.is_cuda and peak >= NBYTES
