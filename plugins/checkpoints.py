"""Atomic sharded checkpoints, collective-misuse guard (issue 5).

Work in progress: declares no hooks yet."""
