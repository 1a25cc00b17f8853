"""Training: memory-aware training steps, the Trainer integration and the monitor."""
