"""Where gradients go: backward hooks -> the reducer (launch order, agreement) -> one bucket
per flat buffer, reduce-scattered into this rank's gradient shard.
Its place among the layers (what it may import): docs/design.md, "Layers"."""
