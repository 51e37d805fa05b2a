"""specpipe: speculative decoding as a pipeline of interchangeable stages."""
from specpipe.pipelines.pipeline import Generation, GenerationStats, Pipeline
from specpipe.types import DecodeState, DraftTree, Proposal, SamplingConfig, StepStats, VerifyResult

__all__ = ["Pipeline", "Generation", "GenerationStats", "Proposal", "DraftTree", "VerifyResult", "StepStats",
           "DecodeState", "SamplingConfig"]
