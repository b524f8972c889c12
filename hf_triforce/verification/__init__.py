"""Exact acceptance: chain and tree verification, sampling, score processing."""
