"""The model's layers and its forward pass over the paged cache: batch metadata, attention,
norms, the dense MLP and the MoE with its router and expert placement, the decoder layers
wired from a ModelConfig, and the native decode stack that runs a decode step's layers in one
call."""
