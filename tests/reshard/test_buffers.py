import ml_dtypes
import numpy as np

from reshard.buffers import Pool, Scratch, copy
from tests.arrays import same

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_pool_reuses_given_back_memory_and_holds_no_more_than_was_lent():
    pool = Pool()
    a = pool.array([4, 8], BF16)
    a[...] = 1
    ptr = a.ctypes.data
    pool.give(a)
    b = pool.array([2, 8], BF16)  # fits in a's buffer: reused
    assert b.ctypes.data == ptr and b.shape == (2, 8) and b.dtype == BF16
    pool.give(b)
    c = pool.array([64], np.dtype(np.float32))  # larger than any free buffer: the small one is dropped
    assert c.size == 64
    pool.give(c)
    assert len(pool._free) == 1


def test_scratch_grows_then_reuses():
    scratch = Scratch()
    small = scratch.array([3], np.dtype(np.float32))
    big = scratch.array([10, 10], np.dtype(np.int64))
    again = scratch.array([5, 5], np.dtype(np.int64))
    assert small.size == 3 and big.shape == (10, 10) and again.ctypes.data == big.ctypes.data


def test_copy_matches_numpy_assignment_for_strided_slices():
    src = np.random.default_rng(0).standard_normal((6, 10)).astype(BF16)
    for dtype in (BF16, np.dtype(np.float32), np.dtype(np.int64)):
        s = src.astype(dtype)
        dest = np.zeros((6, 10), dtype=dtype)
        copy(dest[:, 2:5], s[:, 5:8])
        expected = np.zeros((6, 10), dtype=dtype)
        expected[:, 2:5] = s[:, 5:8]
        assert same(dest, expected)


def test_pool_shrink_keeps_the_largest_idle_buffers():
    pool = Pool()
    lent = [pool.array([n], np.dtype(np.uint8)) for n in (10, 30, 20)]
    for t in lent:
        pool.give(t)
    pool.shrink(1)
    again = pool.array([25], np.dtype(np.uint8))  # served by the kept 30-byte buffer
    assert again.ctypes.data == lent[1].ctypes.data
