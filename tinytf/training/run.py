"""Run a training: the trainer for the device, to the end (what ``train.py`` calls)."""
from __future__ import annotations

from tinytf.training.config import TrainConfig
from tinytf.training.pipelined import PipelinedTrainer
from tinytf.training.trainer import Trainer


def trainer_for(cfg: TrainConfig, comm=None, log_stream=None) -> Trainer:
    """The trainer of ``cfg``: on a GPU the pipelined one (one update in flight, CUDA
    graphs on request), else the plain loop of :class:`tinytf.training.trainer.Trainer`."""
    cls = PipelinedTrainer if cfg.device == "gpu" or cfg.cuda_graph else Trainer
    return cls(cfg, comm=comm, log_stream=log_stream)


def train(cfg: TrainConfig, comm=None, log_stream=None, process_exits: bool = False) -> dict:
    """Run ``cfg`` to the end and return the summary (see :class:`tinytf.training.trainer.Trainer`).
    ``process_exits``: the caller's process ends with the run (the command line), so stop
    signals stay handled after a stop (:class:`tinytf.training.signals.StopSignals`)."""
    trainer = trainer_for(cfg, comm, log_stream)
    trainer.signals.hold_after_stop = process_exits
    return trainer.train()
