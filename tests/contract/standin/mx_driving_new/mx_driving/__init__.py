"""STAND-IN for mx_driving >= 1.0.20260421 (tests/contract only): records the calls made into it."""
CALLS = []
