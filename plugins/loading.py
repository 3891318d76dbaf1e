"""Bounded-memory model loading: truncation, meta-init, staggered materialization (issue 4).

Work in progress: declares no hooks yet."""
