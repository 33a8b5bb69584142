"""Imported once by the fork server that starts the grading sandboxes: torch, kvcourse and the model, ready."""

from .sandbox import preload

preload()
