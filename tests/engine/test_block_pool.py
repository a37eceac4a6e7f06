import pytest

from atom.engine.block_pool import BlockPool, PoolExhausted, block_hashes, chain_hash
from atom.engine.checkpoints import CheckpointStore


def test_chained_hashes_depend_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6], 2)
    b = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert a[1] == chain_hash(a[0], [3, 4])
    assert block_hashes([1, 2, 3], 2) == a[:1]


def test_allocation_prefers_free_then_evicts_lru_cached():
    pool = BlockPool(4)
    evicted = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(4)
    for b, h in zip(blocks, (11, 12, 13, 14)):
        assert pool.register(b, h)
    pool.release([blocks[1], blocks[0]])  # 1 becomes LRU, then 0
    assert pool.num_cached == 2 and pool.num_free == 0
    assert pool.allocate(1) == [blocks[1]]
    assert evicted == [12] and pool.lookup(12) is None
    with pytest.raises(PoolExhausted):
        pool.allocate(2)


def test_acquire_revives_a_cached_block_and_refuses_a_free_one():
    pool = BlockPool(2)
    b = pool.allocate(1)[0]
    pool.register(b, 5)
    pool.release([b])
    pool.acquire([b])
    assert pool.ref[b] == 1 and not pool.is_cached(b)
    free = next(x for x in range(2) if pool.is_free(x))
    with pytest.raises(RuntimeError, match="free"):
        pool.acquire([free])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([free])


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, 7) and not pool.register(b, 7)
    pool.release([b])
    assert pool.is_free(b)  # the duplicate holds no hash: plain free


def test_images_are_dropped_with_their_prefix_and_survive_while_pinned():
    pool = BlockPool(10)
    store = CheckpointStore(pool, units_per_image=2)
    kv = pool.allocate(2)
    pool.register(kv[0], 100)
    pool.register(kv[1], 101)
    img1 = store.create(100, 4, (100,))
    img2 = store.create(101, 8, (100, 101))
    for img in (img1, img2):
        assert store.mark_ready(img)
        store.unpin(img)
    assert store.get_ready(101) is img2
    store.pin(img2)
    pool.release([kv[1], kv[0]])
    pool.forget(kv[1])  # block 101 leaves: img2 is doomed but pinned
    assert store.get_ready(101) is None and img2 in store.limbo
    assert pool.ref[img2.units[0]] == 1  # units still held while pinned
    store.unpin(img2)
    assert not store.limbo and not img2.units
    assert store.get_ready(100) is img1


def test_image_eviction_is_lru_and_skips_pinned():
    pool = BlockPool(6)
    store = CheckpointStore(pool, units_per_image=2)
    imgs = []
    for i in range(3):
        img = store.create(i, 2 * (i + 1), ())
        store.mark_ready(img)
        store.unpin(img)
        imgs.append(img)
    store.pin(imgs[0])
    store.get_ready(1)  # touch 1: 2 is now LRU among unpinned
    assert store.make_room(2)
    assert 2 not in store.images and 0 in store.images and 1 in store.images


def test_image_eviction_takes_leaves_first_so_shared_prefix_images_outlive_their_tails():
    """Without it, the images of shared prefixes (older, so least recently used) went first and
    HBM prefix hits collapsed (0 of 65,536 possible prefix tokens on the CPU repro of the H200
    serving preset once tail images stopped dying early; 65,536 with leaves first)."""
    pool = BlockPool(12)
    store = CheckpointStore(pool, units_per_image=2)
    kv = pool.allocate(3)
    for b, h in zip(kv, (100, 101, 200)):
        pool.register(b, h)
    shared = store.create(100, 4, (100,))  # oldest; extended by the tail image below
    other = store.create(200, 4, (200,))  # a leaf of its own
    tail = store.create(101, 8, (100, 101))
    for img in (shared, other, tail):
        assert store.mark_ready(img)
        store.unpin(img)
    # the oldest leaf goes first, not the shared prefix
    assert store.evict_fewest_dependents() and 200 not in store.images
    assert store.evict_fewest_dependents() and 101 not in store.images  # then the tail
    assert store.evict_fewest_dependents() and 100 not in store.images  # the prefix is a leaf now


def test_a_recomputed_block_takes_the_hash_from_a_cached_copy_without_an_eviction():
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = evicted.append
    old, new = pool.allocate(2)
    assert pool.register(old, 7)
    pool.release([old])  # cached copy
    assert pool.register(new, 7)  # the live block takes the hash over
    assert pool.lookup(7) == new and pool.is_free(old) and pool.hash_of[old] is None
    assert evicted == []


def test_a_twin_keeps_its_hash_resident_when_the_holder_is_evicted():
    """Found in the H200 serving run (82.5% of the reuse ceiling): a request that recomputed a
    prefix another request's block held stayed unhashed; when that cached block was evicted,
    every image the request took (whose prefix included the hash) was dropped, so its tail was
    never stored. The live copy now takes the hash over."""
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = evicted.append
    holder, twin = pool.allocate(2)
    assert pool.register(holder, 7)
    assert not pool.register(twin, 7)  # holder is live: twin stays unhashed
    assert pool.twins() == {twin: 7}
    pool.release([holder])  # holder cached, then evicted by an allocation
    pool.allocate(2)
    assert evicted == [] and pool.lookup(7) == twin and pool.twins() == {}
    pool.release([twin])
    assert pool.is_cached(twin)


def test_a_released_twin_no_longer_keeps_the_hash():
    pool = BlockPool(2)
    evicted = []
    pool.on_evict = evicted.append
    holder, twin = pool.allocate(2)
    pool.register(holder, 7)
    pool.register(twin, 7)
    pool.release([twin])  # unhashed: free
    assert pool.is_free(twin) and pool.twins() == {}
    pool.release([holder])
    pool.allocate(2)
    assert evicted == [7] and pool.lookup(7) is None


def test_a_block_whose_last_reference_is_a_lease_keeps_the_recency_its_sequence_gave_it():
    """A request's tail, whose tier stores finish after the request does, must not look newer
    than its prefix: released by its sequence first (tail first), it is evicted first."""
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = evicted.append
    prefix, tail = pool.allocate(2)
    pool.register(prefix, 1)
    pool.register(tail, 2)
    pool.acquire([tail])  # a store in flight leases the tail
    pool.release([tail, prefix])  # the request finishes: tail first
    pool.release([tail], lease=True)  # the store ends later
    pool.allocate(2)  # the free block, then one eviction
    assert evicted == [2], "the prefix was evicted before its tail"


def test_image_eviction_without_an_unpinned_leaf_takes_the_image_closest_to_the_leaves():
    """While stores in flight pin the newest tail images, no unpinned leaf is left: the LRU
    fallback evicted the oldest image, a shared prefix's (the tier arm's cold pass lost its
    HBM prefix hits). The image the fewest images extend goes first now."""
    pool = BlockPool(16)
    store = CheckpointStore(pool, units_per_image=1)
    kv = pool.allocate(3)
    for b, h in zip(kv, (100, 101, 102)):
        pool.register(b, h)
    root = store.create(100, 4, (100,))  # oldest: extended by everything below
    mid = store.create(101, 8, (100, 101))
    leaf = store.create(102, 12, (100, 101, 102))
    for img in (root, mid, leaf):
        assert store.mark_ready(img)
        store.unpin(img)
    store.pin(leaf)  # a store of the newest tail is in flight
    assert store.evict_fewest_dependents() and 101 not in store.images and 100 in store.images


def test_a_pending_image_survives_the_eviction_of_a_prefix_hash_its_writer_registers():
    """A tier load's image is PENDING while the load runs; a cached copy of a block it loads
    may be evicted meanwhile. The load registers that hash itself, so the image is checked
    when it becomes READY instead of being dropped (8 of 64 H200 requests lost their load)."""
    pool = BlockPool(6)
    store = CheckpointStore(pool, units_per_image=1)
    cached = pool.allocate(1)[0]
    pool.register(cached, 100)
    pool.release([cached])  # an old copy of the prefix block, cached
    landing = pool.allocate(1)[0]  # where the load puts the block
    image = store.create(100, 4, (100,))
    pool.forget(cached)  # the cached copy leaves the pool while the load runs
    assert not image.doomed
    pool.register(landing, 100)  # the load lands and publishes its block
    assert store.mark_ready(image) and store.get_ready(100) is image
    # a PENDING image whose prefix nobody registers is still refused when it becomes READY
    other = store.create(200, 4, (200,))
    assert not store.mark_ready(other)
