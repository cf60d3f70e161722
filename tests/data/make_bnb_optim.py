"""Writes tests/data/bnb_optim.npz: bitsandbytes' 8-bit blockwise reference.

Run in a venv with PyTorch (CPU) and bitsandbytes (made with torch
2.13.0+cpu and bitsandbytes 0.50.2):

    python tests/data/make_bnb_optim.py

The reference is bitsandbytes' own PyTorch implementation of
``quantize_blockwise`` (its ``default`` backend: absmax per block, values
times ``1 / absmax``, ``torch.bucketize`` on the midpoints of the map:
nearest level, a tie to the lower one). Its CPU backend's C++ kernel
rounds differently for the levels below about 1.5e-5 (every positive value
under that goes to level 2.125e-5, not to the nearest level); this script
counts those codes (``cpu_kernel_codes_differ``) and runs bitsandbytes'
CPU 8-bit ``AdamW8bit`` update with the reference quantizer in place of
that kernel.

What it writes (float32 unless said):
- ``map_signed``, ``map_unsigned``: ``create_dynamic_map(signed=...)``.
- ``x``: 5000 fixed values (two full blocks of 2048 and a partial one);
  ``codes_signed`` (uint8) and ``absmax_signed``: ``quantize_blockwise(x,
  code=map_signed, blocksize=2048)``; ``codes_unsigned``/``absmax_unsigned``:
  the same for ``x**2`` with ``map_unsigned`` and blocksize 256.
- ``p0`` (5000 parameters), ``g1``, ``g2`` (gradients), and after each
  ``AdamW8bit`` step (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
  decay 0.01; bitsandbytes' block size for optimizer states is 256):
  ``p{k}``, ``state1_{k}``/``absmax1_{k}`` (first moment, signed map),
  ``state2_{k}``/``absmax2_{k}`` (second moment, unsigned map).
"""

import gc
import inspect
import pathlib

import bitsandbytes as bnb
import bitsandbytes.backends.cpu.ops as cpu_ops
import bitsandbytes.backends.default.ops as default_ops
import bitsandbytes.functional as F
import numpy as np
import torch


def _reference_quantize():
    """bitsandbytes' default-backend quantize_blockwise (registered as ``_``)."""
    found = [
        f
        for f in gc.get_objects()
        if inspect.isfunction(f)
        and f.__module__ == default_ops.__name__
        and "bucketize" in inspect.getsource(f)
        and list(inspect.signature(f).parameters) == ["A", "code", "blocksize"]
    ]
    assert len(found) == 1, found
    return found[0]


quantize = _reference_quantize()


def _direct(a_fp32, code, absmax_out, out_uint8, blocksize):
    out, absmax = quantize(a_fp32, code, blocksize)
    out_uint8.copy_(out)
    absmax_out.copy_(absmax)


cpu_ops._quant_blockwise_fp32_direct = _direct  # the CPU update's requantization

out = {}
out["map_signed"] = F.create_dynamic_map(signed=True).numpy()
out["map_unsigned"] = F.create_dynamic_map(signed=False).numpy()
rng = np.random.default_rng(0)
x = (rng.standard_normal(5000) * np.exp(rng.uniform(-8, 2, 5000))).astype(np.float32)
out["x"] = x
differ = 0
for name, values, blocksize in (("signed", x, 2048), ("unsigned", x**2, 256)):
    code = torch.from_numpy(out[f"map_{name}"])
    q, absmax = quantize(torch.from_numpy(values), code, blocksize)
    out[f"codes_{name}"], out[f"absmax_{name}"] = q.numpy(), absmax.numpy()
    kernel, _ = F.quantize_blockwise(
        torch.from_numpy(values), code=code, blocksize=blocksize
    )
    differ += int((kernel.numpy() != q.numpy()).sum())
out["cpu_kernel_codes_differ"] = np.array(differ)

p = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(5000).astype(np.float32)))
out["p0"] = p.detach().numpy().copy()
opt = bnb.optim.AdamW8bit([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
for k in (1, 2):
    g = (rng.standard_normal(5000) * np.exp(rng.uniform(-6, 0, 5000))).astype(
        np.float32
    )
    out[f"g{k}"] = g
    p.grad = torch.from_numpy(g)
    opt.step()
    s = opt.state[p]
    out[f"p{k}"] = p.detach().numpy().copy()
    for name in ("state1", "absmax1", "state2", "absmax2"):
        out[f"{name}_{k}"] = s[name].numpy().copy()
path = pathlib.Path(__file__).with_name("bnb_optim.npz")
np.savez_compressed(path, **out)
print(f"wrote {path}; C++ kernel codes that differ from the reference: {differ}")
