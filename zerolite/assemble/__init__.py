"""What `zerolite.shard` runs, below its public face: the ranks agree on a plan, then the
flat buffers, masters, re-pointed optimizer, buckets, hooks and stage 3's scheduler are
built into one `ShardState` (`zerolite.assemble.steps.assemble`). The memory tools build a
sharded step through it, so nothing below the public faces calls `shard()`. Layer order:
docs/design.md, "Layers"."""
