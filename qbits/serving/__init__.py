"""Layer 8: serving, from trained float weights to stored low-precision ones.

:func:`convert` turns a model's float weights into stored int8, int4 (two
values per byte) or fp8 weights plus scales, as the training (QAT) forward
pass quantizes them, for linen models, nnx models and functions of any
pytree of parameters alike (one path: the engine's storing pass), or keeps
the codes and scales that post-training quantization chose (a
:class:`qbits.ptq.PtqResult` in place of the params); the serving model
computes with them and equals the QAT forward bit for bit:
``serve(model, config)(serving_params, *inputs)`` for linen models and
functions alike (:class:`ServingParams`, one ``layers`` row per stored
weight), the copy :func:`convert` returns for nnx (its weights held in
place, as nnx holds state). :func:`save` /
:func:`restore` write and read them with Orbax (checking the config);
:func:`size_report` counts the bytes.
"""

from qbits.serving._checkpoint import restore, save
from qbits.serving._convert import convert
from qbits.serving._linen import serve
from qbits.serving._params import ServingParams
from qbits.serving._report import SizeReport, size_report

__all__ = [
    "ServingParams",
    "SizeReport",
    "convert",
    "restore",
    "save",
    "serve",
    "size_report",
]
