"""What the Accelerate and Trainer faces (`zerolite.accelerate`, `zerolite.hf`) share: the
full weights they save and the folders of ``save_state`` (`outputs`). Nothing here imports
transformers. Layer order: docs/design.md, "Layers"."""
