"""Sharded checkpoints: round trips, asynchronous saves, integrity, full disks, resumes
across every change of setup, residuals, an older version's checkpoint, load_pretrained."""
