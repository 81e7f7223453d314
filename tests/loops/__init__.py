"""The training loops users write, and what torch does in them: unused parameters, assigned
gradients, LR schedulers, torch.compile, activation checkpointing."""
