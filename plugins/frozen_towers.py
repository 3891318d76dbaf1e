"""Frozen towers kept out of the DeepSpeed engine (issue 5).

Work in progress: declares no hooks yet."""
