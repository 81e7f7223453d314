"""What one rank holds for a sharded model: its `ShardState` (found through a registry), the
pieces of its shard with their fp32 masters and optimizer state, and the offload tier.
Its place among the layers (what it may import): docs/design.md, "Layers"."""
