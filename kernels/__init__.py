"""Attention and cache kernels: the torch reference (`reference.py`) and device dispatch."""
