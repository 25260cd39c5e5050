"""nodekv: a small inference engine for graph-based long-document QA.

A hand-written Llama forward, a KV cache made of node spans, attention mass between nodes, and an exact FLOP
account. `load_engine()` with no argument loads the default registered model, qwen2.5-0.5b (`nodekv models`).
"""
from nodekv.engine.engine import Engine, load_engine
from nodekv.engine.config import ModelConfig
from nodekv.engine.generation import Generation
from nodekv.engine.sampling import SamplingParams
from nodekv.engine.session import NodeMass, Session

__all__ = ["Engine", "Generation", "ModelConfig", "NodeMass", "SamplingParams", "Session", "load_engine"]
__version__ = "0.1.0"
