"""Helpers the tests share: oracles (parity, mixed precision, the DDP reference), rank
bodies that run_ranks or accelerate launch imports by module name, the combination and
resume matrices, the communication spy. No test lives here: tests/README.md lists what each
helper gives."""
