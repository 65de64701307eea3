"""Weight-only quantization: one object per quantized weight form (int8, int4, their panel
packings) with its tensors and its linear, and the choice between them."""
