"""Layer 7: low-rank adapters (LoRA) and QLoRA on unmodified models.

:func:`apply` puts low-rank adapters on every weight matmul a
:class:`LoraConfig`'s rules match, through the engine
(:func:`qbits.transform.adapt`): Flax linen and nnx layers, custom layers,
raw ``jnp.einsum`` and ``@``, scanned layers, in any function of a pytree of
parameters, without editing the model. The base weights are frozen and held
as ``config.base`` says: float (LoRA), or stored quantized once (QLoRA:
NF4, int4 in groups, int8, fp8), so that fine-tuning holds the quantized
base plus the adapters. It returns ``(fn, base, adapters)``:
``fn(adapters, base, *args)`` runs the model; the optimizer sees only
``adapters``.

- :class:`LoraConfig`, :class:`LoraRule`: rank, alpha, dropout, the
  initialiser of ``A``, per-layer rules, the base's format; YAML
  (:func:`qbits.config.dump`, :func:`qbits.load_config`).
- :func:`apply` -> :class:`Lora` (:class:`LoraFunction`,
  :class:`LoraBase`, adapters); ``fn.layers``: one row per matmul (its
  path, adapter rank, how its base weight is held, why it has no adapter).
- :func:`merge`: adapters folded into the float parameters (quantize them
  again for serving).
- :func:`save_adapters`, :func:`restore_adapters`: the adapters alone,
  with Orbax, checked and checksummed.

The bytes a base or the adapters take:
``sum(x.nbytes for x in jax.tree.leaves(base))``.
"""

from qbits.lora._apply import apply
from qbits.lora._checkpoint import restore_adapters, save_adapters
from qbits.lora._config import LoraConfig, LoraRule
from qbits.lora._function import Lora, LoraBase, LoraFunction
from qbits.lora._merge import merge

__all__ = [
    "Lora",
    "LoraBase",
    "LoraConfig",
    "LoraFunction",
    "LoraRule",
    "apply",
    "merge",
    "restore_adapters",
    "save_adapters",
]
