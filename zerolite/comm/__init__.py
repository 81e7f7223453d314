"""Every byte that crosses ranks: the group, where tensors travel, the collectives (equal,
owned and int8 chunks), small collectives, the ranks' agreement, hybrid groups and the exchange
object of each flat buffer. Nothing else in the package calls a ``torch.distributed``
collective. Its place among the layers (what it may import): docs/design.md, "Layers"."""
