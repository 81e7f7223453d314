"""Where parameters live: flat buffers and their views, a meta-device build, stage 3's
gather-before-use scheduler, and what `zerolite.shard` changes on the model.
Its place among the layers (what it may import): docs/design.md, "Layers"."""
