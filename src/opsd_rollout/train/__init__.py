"""Training with the OPSD step: ``train(TrainConfig(...))`` (``opsd-rollout train``), a loop from a prompt file
to a checkpoint, with held-out evaluation, metrics where users look and exact resume."""

from opsd_rollout.train.data import Example, read_examples
from opsd_rollout.train.config import TrainConfig, load_train_config
from opsd_rollout.train.loop import TrainResult, train
from opsd_rollout.train.setup import OptimizationConfig
from opsd_rollout.train.sft import sft_step

__all__ = ["Example", "OptimizationConfig", "TrainConfig", "TrainResult", "load_train_config", "read_examples",
           "sft_step", "train"]
