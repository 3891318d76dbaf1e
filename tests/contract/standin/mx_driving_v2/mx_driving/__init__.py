"""STAND-IN for DrivingSDK's mx_driving with patcher 2.0 (tests/contract only; never installed).

Mirrors the module paths and the behaviour accel-npu relies on of Ascend/DrivingSDK master
e667017e (2026-04-25) plus ``mx_driving/patcher/transformers_patch.py`` as of 7b10704e. The real
package's ``__init__`` loads its NPU operator library; here only ``CALLS`` records what was called.
"""

CALLS = []
