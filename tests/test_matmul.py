"""edge_agent.runtime.matmul: row-slab products equal the plain product, on any BLAS."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.runtime.matmul import as_f32, matmul_wt


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13, 24, 25, 64])
@pytest.mark.parametrize("slabs", [False, True])
@pytest.mark.parametrize("rows", [1000, 1152])  # a ragged last slab; whole slabs at N = 8
def test_product_equals_x_times_w_transposed(n: int, slabs: bool, rows: int) -> None:
    rng = np.random.default_rng(n)
    w = rng.standard_normal((rows, 96)).astype(np.float32)
    x = rng.standard_normal((n, 96)).astype(np.float32)
    got = matmul_wt(x, w, slabs=slabs)
    assert got.shape == (n, rows) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=0, atol=1e-4)
    if slabs and 2 <= n <= 24:  # slab results are written C-contiguous (no transposing copy)
        assert got.flags.c_contiguous


def test_slab_path_takes_strided_inputs_and_f16_weights() -> None:
    rng = np.random.default_rng(7)
    w16 = rng.standard_normal((300, 64)).astype(np.float16)
    x = rng.standard_normal((64, 8)).astype(np.float32).T  # (8, 64), not C-contiguous
    got = matmul_wt(x, w16, slabs=True)
    np.testing.assert_allclose(got, x @ w16.astype(np.float32).T, rtol=0, atol=1e-4)
    assert w16.dtype == np.float16  # the weight itself is untouched


def test_wide_inputs_skip_slabs_when_no_slab_qualifies() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 20_000)).astype(np.float32)  # < 8 rows per slab would fit
    x = rng.standard_normal((8, 20_000)).astype(np.float32)
    np.testing.assert_allclose(matmul_wt(x, w, slabs=True), x @ w.T, rtol=1e-5, atol=1e-3)


def test_as_f32_keeps_f32_and_widens_f16() -> None:
    a = np.ones(3, np.float32)
    assert as_f32(a) is a
    b = as_f32(np.ones(3, np.float16))
    assert b.dtype == np.float32 and (b == 1).all()
