"""Tensor, sequence and 2-D (data x tensor) parallelism: parallel styles, ``parallelize_module``
with a plan, ``parallelize`` for dtensor.nn Transformers, and ``loss_parallel``."""
from dtensor.parallel.api import gpt_plan, parallelize, parallelize_module, replicate
from dtensor.parallel.loss import loss_parallel
from dtensor.parallel.style import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                    PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "parallelize_module", "parallelize",
           "gpt_plan", "loss_parallel", "replicate"]
