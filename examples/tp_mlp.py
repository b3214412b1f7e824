"""A Megatron-style tensor-parallel MLP with hand-placed DTensor weights, checked against one
process. The collectives are not written anywhere: the sharding rules insert them.

    dtlaunch --nproc 4 examples/tp_mlp.py

fc1's weight is split by output rows (Shard(0)) and fc2's by input columns (Shard(1)), so fc1's
output stays sharded, fc2 produces partial sums, and the loss needs one all-reduce forward; the
input's gradient needs one backward. Each rank prints the collectives of one step; rank 0 prints
the largest difference from the single-process run.
"""
from __future__ import annotations

import numpy as np

import dtensor
import dtensor.nn.functional as F
from dtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from dtensor.comm import count_collectives, get_world


class MLP(dtensor.nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.fc1 = dtensor.nn.Linear(d, hidden)
        self.fc2 = dtensor.nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def main(steps: int = 5) -> None:
    world = get_world()
    mesh = init_device_mesh("cpu", (world.size,), mesh_dim_names=("tp",))
    dtensor.manual_seed(0)
    ref = MLP()
    dtensor.manual_seed(0)
    model = MLP()
    for name, placement in [("fc1", Shard(0)), ("fc2", Shard(1))]:
        layer = getattr(model, name)
        layer.weight = dtensor.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh,
                                                              [placement]))
        bias_placement = Shard(0) if name == "fc1" else Replicate()
        layer.bias = dtensor.nn.Parameter(distribute_tensor(layer.bias.detach(), mesh,
                                                            [bias_placement]))
    opts = [dtensor.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    rng = np.random.default_rng(0)
    for step in range(steps):
        x, y = rng.standard_normal((16, 32), np.float32), rng.standard_normal((16, 32),
                                                                              np.float32)
        ref_loss = ((ref(dtensor.Tensor(x)) - dtensor.Tensor(y)) ** 2).mean()
        ref_loss.backward()
        xin = dtensor.Tensor(x, requires_grad=True)
        with count_collectives() as log:
            out = model(DTensor.from_local(xin, mesh, [Replicate()]))
            loss = ((out - DTensor.from_local(y, mesh, [Replicate()])) ** 2).mean()
            loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if world.rank == 0:
            print(f"step {step}: loss {loss.full_tensor().item():.6f} (one process "
                  f"{ref_loss.item():.6f}); collectives {log.summary()}", flush=True)
        else:
            loss.full_tensor()
    diff = max(float(np.abs(q.full_tensor().numpy() - p.numpy()).max())
               for p, q in zip(ref.parameters(), model.parameters()))
    if world.rank == 0:
        print(f"max |parameter difference| after {steps} AdamW steps: {diff:.2e}")
    assert diff < 1e-5, diff


if __name__ == "__main__":
    main()
