"""STAND-IN for DrivingSDK's mx_driving with patcher 1.0 (tests/contract only; never installed).

Mirrors the module paths and behaviour accel-npu relies on of Ascend/DrivingSDK branch_v26.0.0
(also branch_v7.2.RC1 .. branch_v7.3.0): ``mx_driving.patcher.default_patcher_builder``, no
TransformersNPU anywhere. ``CALLS`` records what was called.
"""

CALLS = []
