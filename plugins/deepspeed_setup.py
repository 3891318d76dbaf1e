"""DeepSpeed setup: precision reconciliation, config precedence, ZeRO-3-safe inference_mode (issue 3).

Work in progress: declares no hooks yet."""
