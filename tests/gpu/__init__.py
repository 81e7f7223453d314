"""What only a GPU can show (skipped without CUDA), and the make gpu-check runner
(gpu_check.py) checked on the CPU."""
