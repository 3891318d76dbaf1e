"""torch/CUDA-script compatibility: autocast('cuda') remap, bf16 .numpy(), fused AdamW (issue 3).

Work in progress: declares no hooks yet."""
