"""Reading an optimized HLO module: its kernels, its GEMMs, what feeds them.

XLA's optimized module (``compiled.as_text()``) is what a device runs: on a
GPU every instruction of the entry computation that is not free (a
parameter, a constant, a bitcast, a tuple element) launches one kernel, a
fusion, a library call (cuBLAS, cuDNN) or a copy. :func:`kernels` lists
them with the bytes each reads and writes, from the shapes alone (XLA's own
cost analysis is empty for a program compiled without a device), and
classifies each:

* ``gemm``: a cuBLAS(Lt) call, a Triton GEMM fusion, a dot;
* ``cast``: writes 8-bit (or narrower) values from wider ones: a
  quantization;
* ``code_layout``: reads and writes the same 8-bit values in another layout
  (a transpose or copy of codes: the waste a cast could have avoided by
  writing the layout the GEMM takes);
* ``output_convert``: a lone convert of a GEMM's output (the GEMM could
  have written that dtype itself);
* ``wide_copy``: writes a float32 copy of a narrower parameter (an amax
  computed on a widened copy of a weight);
* ``reduce``: a reduction to a much smaller output (amax, loss, norms);
* ``other``: the rest (elementwise work, optimizer updates).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

__all__ = ["Gemm", "Kernel", "kernels"]

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
    "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([\d,]*))?")
_INSTR = re.compile(
    r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<type>\([^=]*?\)|\S+) "
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) ")
_FREE = frozenset(
    ("parameter", "constant", "bitcast", "get-tuple-element", "tuple",
     "after-all", "partition-id", "replica-id", "iota")
)  # fmt: skip
_GEMM_CALLS = {
    "__cublas$lt$matmul$f8": "cublaslt_fp8",
    "__cublas$lt$matmul": "cublaslt",
    "__cublas$gemm": "cublas",
}


def _itemsize(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f6") or dtype.startswith("f4"):
        return {"8": 1, "6": 0.75, "4": 0.5}[dtype[1]]
    return _BYTES.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    shape: tuple[int, ...]
    layout: tuple[int, ...]  # minor to major

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> float:
        return self.size * _itemsize(self.dtype)

    @property
    def narrow(self) -> bool:
        """8 bits or fewer, integer or float (codes)."""
        return _itemsize(self.dtype) <= 1 and self.dtype != "pred"

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def _arrays(text: str) -> list[_Array]:
    found = []
    for dtype, dims, layout in _ARRAY.findall(text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        order = tuple(int(d) for d in layout.split(",") if d) if layout else ()
        found.append(_Array(dtype, shape, order or tuple(reversed(range(len(shape))))))
    return found


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a compiled program.

    Attributes:
      kind: ``"cublaslt_fp8"`` (cuBLASLt's FP8 GEMM), ``"cublaslt"``,
        ``"cublas"``, ``"triton"`` (a Triton GEMM fusion), ``"cudnn"``,
        ``"dot"`` (a dot XLA emits itself: the CPU's and the TPU's), or
        another fusion kind.
      lhs: The element type the GEMM reads for its left operand
        (``"f8e4m3fn"``, ``"s8"``, ``"bf16"``...).
      rhs: The same for the right operand.
      out: The element type it writes.
      flops: ``2 M N K`` (integer operations for integer operands).
      contraction_minor: Whether each operand is laid out with its
        contracting axis minor (contiguous), the layout cuBLASLt's 8-bit
        GEMMs take ("TN").
      fast_accumulation: For FP8: whether the GEMM may accumulate in
        reduced precision (``precision=DEFAULT``; ``HIGHEST`` does not).
    """

    kind: str
    lhs: str
    rhs: str
    out: str
    flops: int
    contraction_minor: tuple[bool, bool] = (True, True)
    fast_accumulation: bool = True

    @property
    def low_precision(self) -> bool:
        """Whether both operands are 8-bit (or narrower) codes."""
        return all(_itemsize(t) <= 1 for t in (self.lhs, self.rhs))

    def __str__(self) -> str:
        return f"{self.kind}: {self.lhs} x {self.rhs} -> {self.out}"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program (an entry instruction that runs).

    Attributes:
      name: The instruction's name (the profiler shows the same).
      op: The HLO opcode (``fusion``, ``custom-call``, ``copy``...).
      category: What it does: ``gemm``, ``cast``, ``code_layout``,
        ``output_convert``, ``wide_copy``, ``reduce`` or ``other`` (see the
        module docstring).
      read: Bytes it reads (every operand, whole).
      written: Bytes it writes (a GEMM's workspace not counted).
      inputs: The kernels (or parameters) its operands come from.
      output: Its output types, e.g. ``"bf16[8192,16384]"``.
      gemm: The GEMM it runs, or ``None``.
      fusion_kind: ``kLoop``, ``kInput``, ``kCustom``..., or ``""``.
      transposes: Whether it changes the layout of an operand (a transpose
        inside the kernel or between its input and output layouts).
      where: The JAX name stack of the operation it came from.
      keeps_rows: Whether every transpose in it keeps the minor dimension
        (a permutation of rows of at least :data:`ROW_ELEMENTS` elements,
        such as attention's ``[b, S, h, d] -> [b, h, S, d]``): each row is
        read and written contiguously, whichever emitter runs it.
    """

    name: str
    op: str
    category: str
    read: float
    written: float
    inputs: tuple[str, ...]
    output: str
    gemm: Gemm | None = None
    fusion_kind: str = ""
    transposes: bool = False
    where: str = ""
    keeps_rows: bool = False

    @property
    def nbytes(self) -> float:
        """Bytes moved: read plus written."""
        return self.read + self.written


@dataclasses.dataclass
class _Instr:
    name: str
    op: str
    types: list[_Array]
    args: list[str]
    rest: str
    line: str


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """``{computation name: its instructions}`` and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line and not line[0].isspace():
            header = _HEADER.match(line)
            if header and line.rstrip().endswith("{"):
                current = comps.setdefault(header.group(2), [])
                entry = header.group(2) if header.group(1) else entry
                continue
            if line.startswith("}"):
                current = None
                continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        args = [
            a.strip().split(" ")[-1].lstrip("%")
            for a in re.sub(r"/\*.*?\*/", "", m.group("args")).split(",")
            if a.strip()
        ]
        types = _arrays(m.group("type"))
        current.append(
            _Instr(m.group("name"), m.group("op"), types, args, m.group("rest"), line)
        )
    return comps, entry


def _backend_config(rest: str) -> dict[str, Any]:
    i = rest.find("backend_config=")
    if i < 0:
        return {}
    text = rest[i + len("backend_config=") :]
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return {}


def _dims(rest: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", rest)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _minor(arr: _Array, contracting: tuple[int, ...]) -> bool:
    """Whether ``arr``'s contracting axes are its most minor ones."""
    if not contracting:
        return True
    return set(arr.layout[: len(contracting)]) == set(contracting)


def _gemm(
    kind: str,
    lhs: _Array,
    rhs: _Array,
    out: _Array,
    lc: tuple[int, ...],
    rc: tuple[int, ...],
    fast: bool,
) -> Gemm:
    k = math.prod(lhs.shape[a] for a in lc) if lc else 1
    return Gemm(
        kind, lhs.dtype, rhs.dtype, out.dtype, 2 * out.size * k,
        (_minor(lhs, lc), _minor(rhs, rc)), fast,
    )  # fmt: skip


def _called(instr: _Instr) -> list[str]:
    return re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", instr.rest)


def _inner_dot(
    comps: dict[str, list[_Instr]], name: str, seen: set[str]
) -> tuple[_Instr, dict[str, _Instr]] | None:
    seen.add(name)
    body = comps.get(name, [])
    for instr in body:
        if instr.op in ("dot", "convolution"):
            return instr, {i.name: i for i in body}
        for called in _called(instr):
            if called not in seen:
                found = _inner_dot(comps, called, seen)
                if found:
                    return found
    return None


def _has_op(comps: dict[str, list[_Instr]], name: str, ops: set[str]) -> bool:
    seen: set[str] = set()
    todo = [name]
    while todo:
        comp = todo.pop()
        if comp in seen:
            continue
        seen.add(comp)
        for instr in comps.get(comp, []):
            if instr.op in ops:
                return True
            todo.extend(_called(instr))
    return False


#: The least elements of a row that :attr:`Kernel.keeps_rows` counts: 64 are
#: 64 to 256 contiguous bytes, a whole memory transaction or more.
ROW_ELEMENTS = 64


def _keeps_rows(comps: dict[str, list[_Instr]], name: str) -> bool:
    """Whether computation ``name`` transposes, keeping rows in every transpose.

    A row: the operand's minor dimension, at least :data:`ROW_ELEMENTS`
    long, which is also the result's minor dimension.
    """
    body = comps.get(name, [])
    types = {i.name: i.types for i in body}
    moves = [i for i in body if i.op in ("transpose", "copy")]
    for instr in moves:
        operand = types.get(instr.args[0], []) if instr.args else []
        if not operand or not instr.types:
            return False
        src, out = operand[0], instr.types[0]
        perm = _dims(instr.rest, "dimensions") if instr.op == "transpose" else None
        kept = perm[out.layout[0]] if perm else out.layout[0]
        if kept != src.layout[0] or src.shape[kept] < ROW_ELEMENTS:
            return False
    return bool(moves)


def _op_name(rest: str) -> str:
    m = re.search(r'op_name="([^"]*)"', rest)
    return m.group(1) if m else ""


def kernels(text: str) -> list[Kernel]:
    """The kernels of an optimized HLO module, in program order.

    Args:
      text: The module's text (``jax.jit(f).lower(...).compile().as_text()``).

    Returns:
      One :class:`Kernel` per instruction of the entry computation that
      runs (fusions, library calls, copies, dots...); free instructions
      (parameters, constants, bitcasts, tuples) are left out and looked
      through.

    Example:
      >>> from qbits.hlo._module import kernels
      >>> text = jax.jit(lambda a, b: (a @ b).sum()).lower(
      ...     jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
      >>> [k.category for k in kernels(text)][:1]
      ['gemm']
    """
    comps, entry = _computations(text)
    body = comps.get(entry, [])
    by_name = {i.name: i for i in body}
    params = {i.name for i in body if i.op == "parameter"}
    gemm_outputs: set[str] = set()

    def source(name: str) -> str:
        """The kernel or parameter a value comes from (through free ops)."""
        seen = 0
        while name in by_name and by_name[name].op in (
            "bitcast",
            "get-tuple-element",
            "copy-start",
            "copy-done",
        ):
            name = by_name[name].args[0]
            seen += 1
            if seen > 64:
                break
        return name

    def types_of(name: str) -> list[_Array]:
        instr = by_name.get(name)
        return instr.types if instr is not None else []

    found: list[Kernel] = []
    for instr in body:
        if instr.op in _FREE:
            continue
        ins = [types_of(a) for a in instr.args]
        flat_in = [t for ts in ins for t in ts]
        outs = instr.types
        read = sum(t.nbytes for t in flat_in)
        written = sum(t.nbytes for t in outs)
        inputs = tuple(source(a) for a in instr.args)
        config = _backend_config(instr.rest)
        kind = re.search(r"kind=(\w+)", instr.rest)
        fusion_kind = kind.group(1) if kind else ""
        gemm = None
        target = re.search(r'custom_call_target="([^"]+)"', instr.rest)
        if target and ("cublas" in target.group(1) or "cudnn" in target.group(1)):
            written = outs[0].nbytes if outs else 0  # not the workspace
            gc = config.get("gemm_backend_config", {})
            dn = gc.get("dot_dimension_numbers", {})
            lc = tuple(int(d) for d in dn.get("lhs_contracting_dimensions", []))
            rc = tuple(int(d) for d in dn.get("rhs_contracting_dimensions", []))
            precision = gc.get("precision_config", {}).get("operand_precision", [])
            fast = not any(p == "HIGHEST" for p in precision)
            call = target.group(1)
            kind_name = _GEMM_CALLS.get(call, "cudnn" if "cudnn" in call else call)
            if len(ins) >= 2 and ins[0] and ins[1] and outs:
                gemm = _gemm(kind_name, ins[0][0], ins[1][0], outs[0], lc, rc, fast)
        elif instr.op == "dot" and len(ins) >= 2 and ins[0] and ins[1] and outs:
            gemm = _gemm(
                "dot", ins[0][0], ins[1][0], outs[0],
                _dims(instr.rest, "lhs_contracting_dims"),
                _dims(instr.rest, "rhs_contracting_dims"), True,
            )  # fmt: skip
        elif instr.op == "fusion" and outs:
            gemm = _fused_gemm(comps, instr, config, outs[0])
        if gemm is not None:
            gemm_outputs.add(instr.name)
            category = "gemm"
        else:
            category = _category(instr, ins, outs, inputs, params, gemm_outputs)
        transposes = instr.op in ("transpose", "copy") or (
            instr.op == "fusion"
            and bool(_called(instr))
            and _has_op(comps, _called(instr)[0], {"transpose", "copy"})
        )
        if not transposes and flat_in and outs and instr.op == "fusion":
            big = max(flat_in, key=lambda t: t.size)
            transposes = any(
                o.size == big.size and o.shape == big.shape and o.layout != big.layout
                for o in outs
            )
        keeps_rows = (
            transposes
            and instr.op == "fusion"
            and bool(_called(instr))
            and _keeps_rows(comps, _called(instr)[0])
        )
        output = ", ".join(str(o) for o in outs)
        where = _op_name(instr.rest)
        found.append(
            Kernel(
                instr.name,
                instr.op,
                category,
                read,
                written,
                inputs,
                output,
                gemm,
                fusion_kind,
                transposes,
                where,
                keeps_rows,
            )
        )
    return found


def _fused_gemm(
    comps: dict[str, list[_Instr]],
    instr: _Instr,
    config: dict[str, Any],
    out: _Array,
) -> Gemm | None:
    """The GEMM a fusion runs (a Triton GEMM, a TPU's fused dot), or ``None``."""
    called = _called(instr)
    inner = _inner_dot(comps, called[0], set()) if called else None
    if inner is None:
        return None
    dot, scope = inner
    operands = [_read(scope, a) for a in dot.args[:2] if a in scope and scope[a].types]
    if len(operands) != 2 or not dot.types:
        return None
    backend = config.get("fusion_backend_config", {}).get("kind", "")
    if "triton" in backend:
        kind = "triton"
    elif "cudnn" in backend:
        kind = "cudnn"
    else:  # a dot XLA fuses and emits itself (a TPU's)
        kind = backend.lstrip("_") or "dot"
    if dot.op == "convolution":  # a TPU's dot: contracting 'f' (lhs), 'i' (rhs)
        labels = re.search(r"dim_labels=(\w+)_(\w+)->", dot.rest)
        if labels is None:
            return None
        lhs_labels, rhs_labels = labels.groups()
        lc = (lhs_labels.index("f"),)
        rc = (rhs_labels.index("i"),)
        window = math.prod(
            operands[1].shape[i] for i, c in enumerate(rhs_labels) if c.isdigit()
        )
    else:
        lc = _dims(dot.rest, "lhs_contracting_dims")
        rc = _dims(dot.rest, "rhs_contracting_dims")
        window = 1
    gemm = _gemm(kind, operands[0], operands[1], dot.types[0], lc, rc, True)
    return dataclasses.replace(gemm, out=out.dtype, flops=gemm.flops * window)


def _read(scope: dict[str, _Instr], name: str) -> _Array:
    """What a fused dot's operand reads from memory.

    The operand itself, or, where the fusion widens 8-bit values on the way
    (XLA's FP8 form: ``dot(convert(a) * s, convert(b))``), those values: the
    GEMM reads them narrow.
    """
    arr = scope[name].types[0]
    instr = scope[name]
    for _ in range(16):
        if instr.op not in ("convert", "multiply", "bitcast", "copy", "transpose"):
            break
        ins = [scope[a] for a in instr.args if a in scope and scope[a].types]
        if not ins:
            break
        instr = max(ins, key=lambda i: i.types[0].size)
        if instr.types[0].narrow and instr.types[0].size == arr.size:
            return dataclasses.replace(arr, dtype=instr.types[0].dtype)
    return arr


def _category(
    instr: _Instr,
    ins: list[list[_Array]],
    outs: list[_Array],
    inputs: tuple[str, ...],
    params: set[str],
    gemm_outputs: set[str],
) -> str:
    """What a non-GEMM kernel does (see the module docstring)."""
    if not outs:
        return "other"
    big_in = [t for ts in ins for t in ts if t.size > 1]
    biggest_out = max(outs, key=lambda t: t.size)
    if any(o.narrow for o in outs) and big_in:
        if all(t.narrow for t in big_in):
            return "code_layout"
        return "cast"
    if (
        len(inputs) == 1
        and inputs[0] in gemm_outputs
        and instr.op in ("fusion", "convert")
        and len(outs) == 1
        and big_in
        and outs[0].size == big_in[0].size
        and outs[0].dtype != big_in[0].dtype
    ):
        return "output_convert"
    # A float32 output as large as a narrower parameter it reads, and no
    # float32 input of that size (that would be arithmetic, not a copy).
    for name, ts in zip(inputs, ins, strict=True):
        for t in ts:
            if name not in params or _itemsize(t.dtype) >= 4 or t.size <= 1:
                continue
            wide_out = any(o.dtype == "f32" and o.size == t.size for o in outs)
            wide_in = any(u.size == t.size and _itemsize(u.dtype) >= 4 for u in big_in)
            if wide_out and not wide_in:
                return "wide_copy"
    if big_in and biggest_out.size * 16 <= max(t.size for t in big_in):
        return "reduce"
    return "other"
