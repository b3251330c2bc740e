"""Placing the model on devices: layer split (manual and automatic), planning, tensor parallelism."""
