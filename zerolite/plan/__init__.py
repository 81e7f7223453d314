"""What `zerolite.shard` decides before it builds anything, changing nothing: which optimizers
can be sharded and how, the flat buffers and their layout, stage-3 units, whole-tensor owners,
the offload tier's sizes, which exchanges are quantized, the gradient norm's summation tree,
what each stage shards.
`zerolite.memory.estimate` reuses it.
Its place among the layers (what it may import): docs/design.md, "Layers"."""
