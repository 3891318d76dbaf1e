"""Directory put on PYTHONPATH of launched workers; holds a chaining sitecustomize.py."""
