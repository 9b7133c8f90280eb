"""One rank of the 2-process test in test_distributed.py (importable by spawned processes)."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import mixedad
from mixedad import distributed
from tests.test_input_grad import measurement_objective, outer, problem


def leaves():
    G, z, y, x = problem(n=7)  # 7 codes: uneven shards (4 + 3)
    y = {k: v.clone().requires_grad_() for k, v in y.items()}
    return G, z, y, x.clone().requires_grad_()


def single_process():
    G, z, y, x = leaves()
    outer(mixedad.input_grad(measurement_objective, G, z, y, chunk_size=2), x).backward()
    return {"y": {k: v.grad for k, v in y.items()}, "x": x.grad}


def run(rank, world_size, port, out_dir):
    """One rank, as the target of a spawned process: on success it ends that process (exit code 0)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        G, z, y, x = leaves()
        z_local = distributed.shard(z)
        dfdz = distributed.all_gather_codes(mixedad.input_grad(measurement_objective, G, z_local, y, chunk_size=2))
        (outer(dfdz, x) / world_size).backward()
        distributed.all_reduce_grads([y, x])
        torch.save({"y": {k: v.grad for k, v in y.items()}, "x": x.grad, "n_local": len(z_local),
                    "dfdz": dfdz.detach()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither rank tears the group down while the other still communicates
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalisation. A gloo worker thread releases each finished
    # collective's tensors after the caller's wait() has returned; a tensor whose Python object
    # is gone by then needs the GIL to be freed, and a thread that takes the GIL while the
    # interpreter finalises is ended with pthread_exit, which aborts the process from a noexcept
    # frame ("terminate called without an active exception", exit code -6). Seen about 1 run in
    # 5 here, barrier or not; core dumps show ProcessGroupGloo::runLoop -> ~AsyncWork ->
    # decref_pyobject -> take_gil -> PyThread_exit_thread. Upstream: pytorch#190489, #179291.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
