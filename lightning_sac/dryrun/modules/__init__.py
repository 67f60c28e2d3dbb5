"""Per-module recording: the hooks around every module call, backward signals, the model's own checkpoints."""
