"""Weight products for the forward: `x @ w.T` shaped for OpenBLAS's small-matrix kernel.

Invariants this module owns:
- A weight is never copied or rewritten: row slabs are views of the caller's memory (float16
  weights are widened per call, which is a temporary, not a stored copy).
- Each output element is one dot product over the full input width, whatever the slabbing, so
  the result is the same as a single `w @ x.T` up to BLAS summation order.
"""

from __future__ import annotations

import numpy as np

__all__ = ["blas_has_small_kernel", "matmul_wt", "as_f32"]

# OpenBLAS's SkylakeX-family kernels (x86-64 with AVX-512) multiply without packing their
# operands when M*N*K <= 100**3 and, for the "TN" case that both `x @ w.T` and `w @ x.T` map
# to, M*N <= 1200 (kernel/x86_64/sgemm_small_kernel_permit_skylakex.c). Packing rereads and
# rewrites the whole weight on every call, which dominates at small batch: slicing the
# weight's rows into slabs that qualify measured 1.3-2x faster at N = 4..12, ~10 % at 16-24,
# and no gain at 32. Other kernels (Haswell, ARM) have no such path, so there the weight goes
# to BLAS in one call. Re-measured at N = 8 on the real weights: slabs of the largest
# qualifying height are the fastest; taller ones fall back to packing (1.4-1.6x slower), and
# `w @ x.T` with x.T C-contiguous (OpenBLAS's direct/NN paths), a transposed weight copy, or
# Q/K/V and gate/up fused into one weight (one stream, fewer calls) were no faster.
_SMALL_MNK = 100**3
_SMALL_MN = 1200
_SLAB_MAX_N = 24
_SLAB_KERNELS = frozenset({"skylakex", "cooperlake", "sapphirerapids"})


def blas_has_small_kernel() -> bool:
    """True if numpy's BLAS is OpenBLAS running a kernel with the unpacked small-matrix path.

    Reads threadpoolctl's view (which follows OPENBLAS_CORETYPE); False when unknown.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return False
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            arch = str(info.get("architecture") or "").lower()
            return info.get("internal_api") == "openblas" and arch in _SLAB_KERNELS
    return False


def as_f32(w: np.ndarray) -> np.ndarray:
    return w if w.dtype == np.float32 else w.astype(np.float32)


def matmul_wt(x: np.ndarray, w: np.ndarray, *, slabs: bool = False) -> np.ndarray:
    """x (N, in) @ w.T where w is (out, in); float16 weights are widened for this call.

    With `slabs` and 2 <= N <= 24 the weight is taken in row slabs (views, no copy) sized for
    OpenBLAS's unpacked small-matrix kernel, each product written straight into its columns of
    one C-contiguous (N, out) result: `x @ slab.T` measured ~9 % faster over a batch-8 step's
    products than `(slab @ x.T).T` into an (out, N) buffer, and the result needs no transposing
    copy downstream (q/k for RoPE, logits for sampling). Otherwise the product is computed as
    (w @ x.T).T, one BLAS call: N = 1 is a matrix-vector product, and larger N (prefill)
    amortise OpenBLAS's packing; that result is a transposed view of an (out, N) buffer.
    """
    w = as_f32(w)
    n = x.shape[0]
    n_out, n_in = w.shape
    if slabs and 2 <= n <= _SLAB_MAX_N:
        rows = min(_SMALL_MNK // (n * n_in), _SMALL_MN // n) // 8 * 8
        if 8 <= rows < n_out:
            xc = np.ascontiguousarray(x)  # (N, in)
            out = np.empty((n, n_out), dtype=np.float32)  # (N, out)
            whole = n_out // rows * rows
            # The S = whole // rows full slabs in one matmul call (numpy loops over them in
            # C, one BLAS call each) instead of S Python-level calls: ~1,500 fewer per
            # batch-8 step of the default model. The last, shorter slab (if any) after it.
            np.matmul(xc[None], w[:whole].reshape(-1, rows, n_in).transpose(0, 2, 1),
                      out=out[:, :whole].reshape(n, -1, rows).transpose(1, 0, 2))
            if whole < n_out:
                np.matmul(xc, w[whole:].T, out=out[:, whole:])
            return out  # (N, out)
    out_t: np.ndarray = (w @ x.T).T  # (N, out)
    return out_t
