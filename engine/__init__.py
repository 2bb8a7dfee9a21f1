"""The NPUMoE engine: MoE prefill on static-shape accelerators (knows nothing of files or queues)."""
