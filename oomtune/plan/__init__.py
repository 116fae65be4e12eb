"""Prediction with the virtual GPU: capture a workload's request stream on the meta device and replay
it under allocator settings (``oomtune plan``, trial pruning, ``oomtune check --mode predict``)."""

from oomtune.plan.predictor import Prediction, Predictor, capture_training_stream

__all__ = ["Prediction", "Predictor", "capture_training_stream"]
