"""Sharded safetensors checkpoints (see DESIGN §5); the API lands with the checkpoint issue."""
