"""The accel-npu plugin shipped by the DiT4DiT-style repo (entry point ``dit4dit``)."""
