"""Attention dispatch and CPU/CUDA kernels, tree attention, output head, int8 copies."""
