"""Serving many requests at once (chapter 6): the model runner; the scheduler and engine build on it."""

from .model_runner import ModelRunner

__all__ = ["ModelRunner"]
