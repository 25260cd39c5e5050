"""GoR (gor.txt): a graph of chunks and the model's responses to simulated queries, ranked by a GAT trained
self-supervised."""
from .gor import Gor

__all__ = ["Gor"]
