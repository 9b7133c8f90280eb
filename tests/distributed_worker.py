"""One rank of the 2-process test in test_distributed.py (importable by spawned processes)."""
import datetime
import os

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
    finally:
        dist.destroy_process_group()
