"""JERR (jerr.txt): synopses, de-duplicated entities in a DAG with LLM edge attributes, searched by MCTS."""
from .jerr import Jerr

__all__ = ["Jerr"]
