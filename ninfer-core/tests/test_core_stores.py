"""Physical stores: paged KV pool accounting and copy-on-write, StateImage slot views and host copies."""

import pytest
import torch

from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout
from ninfer.core.device import Device, torch_dtype
from ninfer.core.kv_pool import PageAllocator, PagedKVPool, PoolExhausted, pages_for
from ninfer.core.state_store import StateImageStorage

CPU = Device("cpu")


def test_device_parse():
    assert Device.parse("cpu") == CPU
    assert str(Device.parse(torch.device("cpu"))) == "cpu"
    with pytest.raises(ValueError, match="unsupported device type"):
        Device.parse("meta")
    with pytest.raises(ValueError, match="invalid device"):
        Device.parse("gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Device.parse("cuda:0")
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("float13")


def test_page_allocator_exact_accounting():
    a = PageAllocator(4)
    p = a.allocate(3)
    assert a.num_used == 3 and a.num_free == 1
    with pytest.raises(PoolExhausted, match="1 free pages, 2 requested"):
        a.allocate(2)
    assert a.num_free == 1  # all or nothing
    a.share(p[:1])
    a.free(p)
    assert a.num_used == 1 and a.refcount(p[0]) == 1
    a.free(p[:1])
    assert a.num_used == 0
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p[:1])
    with pytest.raises(ValueError, match="outside"):
        a.share([9])
    assert pages_for(0, 16) == 0 and pages_for(16, 16) == 1 and pages_for(17, 16) == 2


def test_kv_pool_views_cow_and_host_roundtrip():
    spec = KVPoolSpec(name="main", layers=2, kv_heads=2, head_dim=4, dtype="float32", page_size=4)
    pool = PagedKVPool(spec, num_pages=5, device=CPU)
    assert pool.nbytes == 5 * spec.nbytes_per_page == 5 * PagedKVPool.page_bytes(spec)
    (k0, v0), (k1, _) = pool.caches()
    assert k0.shape == (5, 4, 2, 4) and k0.data_ptr() != v0.data_ptr()
    pages = pool.allocator.allocate(2)
    k1[pages[0]].fill_(3.0)
    (new,) = pool.allocator.allocate(1)
    pool.copy_page(pages[0], new)
    assert torch.equal(k1[new], k1[pages[0]])
    host = torch.empty(pool.host_shape(2))
    pool.read_pages([pages[0], new], host)
    pool.storage.zero_()
    pool.write_pages([new, pages[1]], host)
    assert torch.all(k1[pages[1]] == 3.0)


def _layout(steps=1):
    return StateImageLayout(fields=(
        StateField(name="conv", dtype="bfloat16", shape=(6, 3), layers=3),
        StateField(name="recurrent", dtype="float32", shape=(2, 4, 4), layers=3, per_step=True),
    ), steps=steps)


def test_state_store_views_are_strided_slot_images():
    store = StateImageStorage(_layout(), num_slots=3, device=CPU)
    conv, rec = store.view("conv"), store.view("recurrent")
    assert conv.shape == (3, 3, 6, 3) and conv.dtype == torch.bfloat16
    assert rec.shape == (3, 3, 2, 4, 4) and rec.dtype == torch.float32
    assert rec.stride(0) * 4 == store.image_bytes == conv.stride(0) * 2
    s0, s1 = store.allocate(), store.allocate()
    rec[s1, 2].fill_(1.5)
    conv[s1].fill_(-2.0)
    assert torch.count_nonzero(store.buffer[s0]) == 0  # fields never overlap another slot
    image = store.save(s1)
    store.zero(s1)
    assert torch.count_nonzero(store.buffer[s1]) == 0
    store.restore(s0, image)
    assert torch.all(rec[s0, 2] == 1.5) and torch.all(conv[s0] == -2.0) and torch.all(rec[s0, :2] == 0)
    store.copy_slot(s0, s1)
    assert torch.equal(store.buffer[s0], store.buffer[s1])
    with pytest.raises(ValueError, match="expected"):
        store.restore(s0, torch.zeros(3, dtype=torch.uint8))
    store.free(s0)
    store.free(s1)
    assert store.num_used == 0
    with pytest.raises(ValueError, match="not allocated"):
        store.free(s1)
    with pytest.raises(KeyError, match="no field"):
        store.view("nope")


def test_state_store_per_step_copies_and_exhaustion():
    store = StateImageStorage(_layout(steps=3), num_slots=1, device=CPU)
    assert store.view("recurrent").shape == (1, 3, 3, 2, 4, 4)
    assert store.view("conv").shape == (1, 3, 6, 3)
    store.allocate()
    with pytest.raises(PoolExhausted, match="all 1 StateImage slots"):
        store.allocate()


def test_kv_pool_transfers_in_blocks():
    spec = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=2, dtype="float32", page_size=2)
    pool = PagedKVPool(spec, num_pages=7, device=CPU)
    pool.transfer_block_bytes = 3 * pool.nbytes_per_page
    pool.storage.copy_(torch.arange(pool.storage.numel(), dtype=torch.float32).view_as(pool.storage))
    pages = [6, 0, 3, 5, 1, 2, 4]
    host = torch.empty(pool.host_shape(7))
    pool.read_pages(pages, host)
    assert torch.equal(host, pool.storage[:, :, pages])
    pool.write_pages(pages[::-1], host)
    assert torch.equal(pool.storage[:, :, pages[::-1]], host)
