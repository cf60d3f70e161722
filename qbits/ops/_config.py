"""What an op checks of its config and key."""

from __future__ import annotations

from typing import Any

import jax

from qbits._errors import InvalidArgumentError
from qbits.config import _IDENTITY as IDENTITY
from qbits.config import _as_dot_general_config
from qbits.config import _DotGeneralConfig as DotGeneralConfig
from qbits.config import _MatmulConfig as MatmulConfig
from qbits.numerics import _check_key as check_key

__all__ = [
    "IDENTITY",
    "DotGeneralConfig",
    "MatmulConfig",
    "check_config",
]


def check_config(
    owner: str, config: Any, key: Any
) -> tuple[DotGeneralConfig, jax.Array | None]:
    """``config`` resolved and its key checked: ``(config, key or None)``.

    ``config`` is a :class:`~qbits.DotGeneralConfig`, a preset name or the
    path of a YAML file (text and plain data too), as every entry point
    takes it.

    Raises:
      InvalidArgumentError: For another type, a key that is not one key
        (a typed key, or 2 or 4 uint32 words), or a config that rounds
        stochastically without a key (at once, not inside a backward pass).
      ConfigError: For a file that does not hold one config.
    """
    config = _as_dot_general_config(owner, config)
    if key is not None:
        return config, check_key(owner, key)
    if config.needs_key:
        raise InvalidArgumentError(
            owner,
            "key",
            None,
            "a PRNG key (jax.random.key(...))",
            why="the config rounds stochastically",
        )
    return config, None
