"""The vendored upstream test trees (``*/tests``) are not this suite's tests: they run unchanged, with
upstream's own conftest, only through tools/upstream_equivalence.py (tests/test_upstream_equivalence.py
starts them in their own processes)."""
collect_ignore_glob = ["*-v*/tests"]
