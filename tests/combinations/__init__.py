"""Features crossed with each other: the pairwise matrix and the combinations checked in
depth."""
