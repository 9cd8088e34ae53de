"""The PS's training engine: an OPT-style model whose GEMMs go through an executor, its data,
trainer and checkpoints. See docs/engine.md."""

from testbed.ps_backend.engine.checkpoint import (
                                                  CheckpointError,
                                                  checkpoint_name,
                                                  latest_checkpoint,
                                                  load_checkpoint,
                                                  save_checkpoint,
)
from testbed.ps_backend.engine.data import BatchSampler, Corpus, DataError, load_corpus
from testbed.ps_backend.engine.model import OptDecoder, count_parameters
from testbed.ps_backend.engine.offload import GemmContext, OffloadedLinear
from testbed.ps_backend.engine.trainer import StepResult, Trainer

__all__ = ["BatchSampler", "CheckpointError", "checkpoint_name", "Corpus", "DataError",
           "GemmContext",
           "OffloadedLinear", "OptDecoder", "StepResult", "Trainer", "count_parameters",
           "latest_checkpoint", "load_checkpoint", "load_corpus",
           "save_checkpoint"]
