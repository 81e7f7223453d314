"""The offload tier: optimizer state on disk or in host memory, bitwise the in-memory run,
reserved before the ranks agree, streamed through checkpoints."""
