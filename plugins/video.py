"""decord on machines without CUDA (issue 3).

Work in progress: declares no hooks yet."""
