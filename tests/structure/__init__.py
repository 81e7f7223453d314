"""The package's shape, read from the source: layers, import order, no back-channel, the
map in docs/design.md, collectives only in comm/."""
