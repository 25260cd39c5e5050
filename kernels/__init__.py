"""Compute kernels beside their thin wrappers, with the torch reference of the same math."""
