"""draftsmith inference: drafting, tree verification and lossless speculative generation."""
from infer.drafters import Chain, DynamicTree, Sampling, StaticTree
from infer.generator import GenerationStats, SpeculativeGenerator

__all__ = ["Chain", "DynamicTree", "GenerationStats", "Sampling", "SpeculativeGenerator", "StaticTree"]
