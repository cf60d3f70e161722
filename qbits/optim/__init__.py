"""Layer 7: optimizers whose moment states are stored in 8 or 4 bits.

Imported on its own: ``from qbits import optim``.

- :func:`adamw`: ``optax.adamw`` with its two moments stored quantized
  (8-bit dynamic by default, as bitsandbytes' ``AdamW8bit``; 4-bit as
  torchao's; FP8 E4M3).
- :func:`quantize_states`: any moment-keeping optax transformation
  (``adam``, ``lion``, ``sgd`` with momentum, ...) with its moments
  stored quantized; its state is a :class:`QuantizedStates`.
- :class:`QuantizedMoment`: one moment as codes and blockwise absmax
  scales (the maps are described there).

Every step dequantizes the moments, runs the float update and quantizes
them again, inside the caller's ``jit``; the states keep their
parameter's sharding and save with Orbax like any optax state. The
package uses qbits' float formats, noise (stochastic rounding) and
4-bit packing; nothing above it.
"""

from qbits.optim._blockwise import QuantizedMoment
from qbits.optim._transform import QuantizedStates, adamw, quantize_states

__all__ = [
    "QuantizedMoment",
    "QuantizedStates",
    "adamw",
    "quantize_states",
]
