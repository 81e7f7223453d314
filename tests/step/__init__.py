"""One optimizer step at stages 1-2 (and 3 where the rule is the same) against
single-process and DDP training: parity, the same arithmetic at every stage, accumulation,
clipping, mixed precision, overlap, whole-tensor ownership."""
