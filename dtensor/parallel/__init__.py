"""Tensor, sequence and data parallelism: parallel styles, ``parallelize_module`` with a plan,
``plan`` (a plan found from any model's traced forward, explained) and ``parallelize`` (found
and applied), ``loss_parallel``, and ``replicate`` (DDP) and ``fully_shard`` (FSDP2) for any
module."""
from dtensor.parallel.api import (distribute_module, from_pretrained, gpt_plan, llama_tp_plan,
                                  parallelize, parallelize_module)
from dtensor.parallel.data_parallel import fully_shard, replicate
from dtensor.parallel.loss import loss_parallel
from dtensor.parallel.planner import Plan, plan
from dtensor.parallel.style import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                    PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "parallelize_module", "parallelize",
           "gpt_plan", "llama_tp_plan", "from_pretrained", "distribute_module", "loss_parallel",
           "replicate", "fully_shard", "plan", "Plan"]
