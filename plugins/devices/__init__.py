"""Device backends, one plugin each: npu (Ascend, torch_npu), cuda (pass-through), cpu (gloo)."""
