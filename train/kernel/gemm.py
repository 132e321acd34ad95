"""The GEMMs of the fused losses under mopd's precision policy (docs/divergences.md, "Precision").

Every product is fp32. On CUDA, bf16/fp16 operands go in as they are with an fp32 output; on the CPU
they are upcast by the caller (`operand`), since its bf16 GEMMs are slower than its fp32 ones.
"""

from __future__ import annotations

import torch


def native_gemms(device: torch.device) -> bool:
    """Whether bf16/fp16 operands go into the GEMMs as they are, with an fp32 product: on CUDA, whose
    tensor cores run them ~14x faster than fp32 and return the exact fp32 sum of exact bf16 × bf16
    products (`out_dtype`). The CPU's bf16 GEMMs are slower than its fp32 ones: there, operands are
    upcast, each teacher head only while its tokens are in flight."""
    return device.type == "cuda"


def operand(x: torch.Tensor, native: bool) -> torch.Tensor:
    """A GEMM operand under the precision policy: as it is where GEMMs are native or it is fp32 (fp32
    inputs stay fp32 everywhere), else an fp32 copy."""
    return x if native or x.dtype == torch.float32 else x.float()


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = a @ b: fp32 operands, or bf16/fp16 ones of one dtype on CUDA with an fp32 product.
    Operands of two dtypes (an fp32 student over a bf16 store) meet in fp32."""
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def mm_add(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> None:
    """acc (fp32) += a @ b, for operands as `_mm` takes them."""
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def split_gradient(grad: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """An fp32 gradient as GEMM operands of `dtype`: itself when that is fp32, else hi + lo, its
    rounding to `dtype` and the rounding of what that left out. Rounded once, as autograd's bf16
    backward of a linear layer does, it would carry a 2⁻⁸ relative error into both gradients; the two
    terms carry 2⁻¹⁶, for one more GEMM each on tensor cores (still ~7x faster than fp32 GEMMs)."""
    if dtype == torch.float32:
        return (grad,)
    hi = grad.to(dtype)
    return hi, grad.sub_(hi).to(dtype)
