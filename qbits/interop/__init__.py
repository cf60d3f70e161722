"""Layer 8: standard quantized checkpoints, read and written.

:func:`read_checkpoint` reads a checkpoint that PyTorch tools quantized
(safetensors shards and the ``quantization_config`` of ``config.json``:
GPTQ, AWQ, compressed-tensors, DeepSeek's block FP8) into qbits' stored weights (a
:class:`Checkpoint`: codes, scales and zero points, never a float copy of a
weight); :func:`write_checkpoint` writes qbits' stored weights (a
:func:`qbits.ptq.quantize_weights` result's, a checkpoint's) in those
formats for PyTorch serving engines. :func:`serving_params` maps a
checkpoint's PyTorch tensor names onto a JAX model's parameters (built-in
tables for Hugging Face Llama and qbits' example LM) and gives the serving
params :func:`qbits.serving.serve` runs. Guide: docs/guides/checkpoint-formats.md.
"""

from qbits.interop._checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from qbits.interop._mapping import serving_params

__all__ = [
    "Checkpoint",
    "read_checkpoint",
    "serving_params",
    "write_checkpoint",
]
