"""``qbits import``: read and check a pre-quantized checkpoint."""

from __future__ import annotations

import argparse

import numpy as np


def _import(args: argparse.Namespace) -> int:
    """Reads ``args.checkpoint`` with :func:`qbits.interop.read_checkpoint`.

    Prints each quantized weight as qbits stores it (its PyTorch module,
    format and grid, ``[in, out]`` shape, bits per weight with scales and
    zero points) and the float tensors beside them; a bad checkpoint is
    the reader's one-line error (status 2).
    """
    import qbits.interop

    ckpt = qbits.interop.read_checkpoint(args.checkpoint)
    width = max(24, *(len(m) for m in ckpt.weights))
    print(f"{args.checkpoint}: {ckpt.format}, {len(ckpt.weights)} quantized weights")
    print(f"{'module':<{width}} {'stored':<32} {'[in, out]':>12} {'bits/weight':>11}")
    held = count = 0
    for m, qt in sorted(ckpt.weights.items()):
        grid = ckpt.quantizers[m].granularity
        what = f"{qt.qdtype.name} {type(grid).__name__}"
        if getattr(grid, "tile_size", None):
            what += f"({grid.tile_size})"
        what += " + zero points" if qt.zero_point is not None else ""
        n = int(np.prod(qt.shape))
        held, count = held + qt.nbytes, count + n
        shape = f"{list(qt.shape)}"
        print(f"{m:<{width}} {what:<32} {shape:>12} {8 * qt.nbytes / n:>11.3f}")
    floats = sum(int(np.prod(t.shape)) for t in ckpt.tensors.values())
    print(
        f"{8 * held / count:.3f} bits a quantized weight; {len(ckpt.tensors)} "
        f"float tensors ({floats} values) beside them"
    )
    return 0
