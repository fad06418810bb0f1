import torch

from reshard.buffers import Pool, Scratch, copy


def test_pool_reuses_given_back_memory_and_holds_no_more_than_was_lent():
    pool = Pool()
    a = pool.tensor([4, 8], torch.bfloat16)
    a.fill_(1)
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.tensor([2, 8], torch.bfloat16)  # fits in a's buffer: reused
    assert b.data_ptr() == ptr and b.shape == (2, 8) and b.dtype == torch.bfloat16
    pool.give(b)
    c = pool.tensor([64], torch.float32)  # larger than any free buffer: the small one is dropped
    assert c.numel() == 64
    pool.give(c)
    assert len(pool._free) == 1


def test_scratch_grows_then_reuses():
    scratch = Scratch()
    small = scratch.tensor([3], torch.float32)
    big = scratch.tensor([10, 10], torch.int64)
    again = scratch.tensor([5, 5], torch.int64)
    assert small.numel() == 3 and big.shape == (10, 10) and again.data_ptr() == big.data_ptr()


def test_copy_matches_torch_for_strided_slices():
    src = torch.randn(6, 10).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        s = src.to(dtype)
        dest = torch.zeros(6, 10, dtype=dtype)
        copy(dest[:, 2:5], s[:, 5:8])
        expected = torch.zeros(6, 10, dtype=dtype)
        expected[:, 2:5] = s[:, 5:8]
        assert torch.equal(dest, expected)


def test_pool_shrink_keeps_the_largest_idle_buffers():
    pool = Pool()
    lent = [pool.tensor([n], torch.uint8) for n in (10, 30, 20)]
    for t in lent:
        pool.give(t)
    pool.shrink(1)
    again = pool.tensor([25], torch.uint8)  # served by the kept 30-byte buffer
    assert again.data_ptr() == lent[1].data_ptr()
