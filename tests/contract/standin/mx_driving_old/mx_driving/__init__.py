"""STAND-IN for mx_driving <= 0.9.x (tests/contract only): records the calls made into it."""
CALLS = []
