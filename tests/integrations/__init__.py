"""Accelerate, the HF Trainer and transformers' own loops and models, against their stock
runs under DDP."""
