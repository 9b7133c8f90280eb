"""Latent codes sharded over 2 CPU processes (gloo, loopback) give the single-process gradients."""
import multiprocessing
import socket
import time

import pytest
import torch
import torch.distributed as dist

from mixedad import distributed
from mixedad.testing import assert_close
from tests import distributed_worker

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_single_process(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=distributed_worker.run, args=(rank, 2, port, str(tmp_path))) for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join()
    assert not stuck, "a rank did not finish within 120 s"
    assert [p.exitcode for p in procs] == [0, 0]

    expected = distributed_worker.single_process()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["n_local"] for r in results] == [4, 3]
    for r in results:
        assert_close(r["y"], expected["y"], what="y.grad after all_reduce")
        assert_close(r["x"], expected["x"], what="x.grad after all_reduce")
    assert_close(results[0]["dfdz"], results[1]["dfdz"])


def test_helpers_need_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised; call torch.distributed.init_process_group"):
        distributed.shard(torch.ones(4))
