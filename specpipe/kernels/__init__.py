"""Tree attention for the verify forward.

- `reference`: the pure-torch definition (no Triton needed).
- `tree_attention`: the Triton kernel; importing it imports Triton and registers its
  transformers attention function, so only `attention=triton` (or `auto` on CUDA) imports it.
- `hf_adapter`: wraps either one in transformers' attention-function signature.
"""
