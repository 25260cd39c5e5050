"""PECAN (pecan.txt): an attention-weighted graph of chunks and summary points, searched by the model's own attention
and p(Yes) on a node-granular KV cache."""
from .pecan import Pecan

__all__ = ["Pecan"]
