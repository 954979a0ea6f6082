"""`pi2-gguf plan`: predicted decode speed and bytes read per token under memory budgets, from this machine's
measured disk and compute (device.py, cached) and the sidecar's statistics (model_stats.py), by the model of
predict.py; report.py prints the table, the recommendation and the command."""

from __future__ import annotations

from .predict import predict_decode

__all__ = ["predict_decode"]
