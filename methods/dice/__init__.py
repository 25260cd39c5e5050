"""DICE (dice.txt): planned sub-questions with retrieval and fact extraction (Alg. 1), or knowledge-constrained
decoding (Alg. 2)."""
from .dice import Dice

__all__ = ["Dice"]
