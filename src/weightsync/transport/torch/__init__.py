"""The torch transport: gloo on host memory, NCCL (nccl4py) on GPU memory, and NCCL's delta
link."""
