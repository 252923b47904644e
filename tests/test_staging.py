"""Staging: a batch is gathered into the runner's reused buffers, never a new batch-sized array.

The Batcher, ``run_requests`` (PyTriton, the Triton backend, Ray) and every runner share
``runners.staging``; these tests hold its contract: each request's rows land where they
belong, outputs that alias a buffer are copied before they leave, a single contiguous
request on the host is not copied, and a steady load allocates nothing batch-sized.
"""

from __future__ import annotations

import asyncio
import threading
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import each_client
from servekit import Batcher, BatchingPolicy, FunctionRunner, ModelSpec, TensorSpec
from servekit.batching.execute import run_requests
from servekit.runners.staging import StagingPool

IMAGE = (3, 64, 64)  # 48 KB of float32 a row: a batch of 32 is 1.5 MB
SPEC = ModelSpec(
    (TensorSpec("x", np.float32, list(IMAGE)),), (TensorSpec("y", np.float32, [1]),), 32
)


def mean_of_rows(inputs):
    x = inputs["x"]
    return {"y": x.reshape(len(x), -1).mean(axis=1, keepdims=True)}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=8),
    st.lists(st.integers(1, 5), min_size=1, max_size=8),
)
def test_gather_puts_each_requests_rows_in_order_and_reuses_the_buffer(first, second):
    pool = StagingPool(40)
    for rows in (first, second):
        parts = [np.random.default_rng(i).random((n, 3), np.float32) for i, n in enumerate(rows)]
        with pool.lend() as staging:
            got = staging.gather([{"x": p} for p in parts], ["x"])["x"]
            np.testing.assert_array_equal(got, np.concatenate(parts))
    assert pool.allocations <= 1 + max(sum(first), sum(second)).bit_length()


def test_a_single_contiguous_request_passes_through_uncopied_on_the_host():
    x = np.ones((4, 3), np.float32)
    with StagingPool(8).lend() as staging:
        assert staging.gather([{"x": x}], ["x"])["x"] is x
        strided = np.ones((4, 6), np.float32)[:, ::2]
        got = staging.gather([{"x": strided}], ["x"])["x"]
        assert got.flags.c_contiguous and np.array_equal(got, strided)


def test_a_pinned_pool_copies_even_a_single_request_into_its_buffer():
    x = np.ones((4, 3), np.float32)
    with StagingPool(8, pinned=True).lend() as staging:
        got = staging.gather([{"x": x}], ["x"])["x"]
        assert got is not x and not np.shares_memory(got, x) and np.array_equal(got, x)


def test_outputs_that_alias_the_buffer_are_copied_before_they_leave():
    pool = StagingPool(8)
    with pool.lend() as staging:
        batch = staging.gather([{"x": np.full((2, 3), 1.0)}, {"x": np.full((1, 3), 2.0)}], ["x"])
        own = np.zeros(3)
        safe = staging.detach({"same": batch["x"], "view": batch["x"][1:], "own": own})
    assert not np.shares_memory(safe["same"], batch["x"])
    assert not np.shares_memory(safe["view"], batch["x"])
    assert safe["own"] is own


def test_bytes_tensors_are_concatenated_not_kept_in_a_buffer():
    a, b = np.array([[b"a"]], dtype=object), np.array([[b"b"], [b"c"]], dtype=object)
    with StagingPool(8).lend() as staging:
        got = staging.gather([{"s": a}, {"s": b}], ["s"])["s"]
    assert got.tolist() == [[b"a"], [b"b"], [b"c"]] and staging.allocations == 0


def test_concurrent_batches_each_borrow_their_own_staging():
    pool = StagingPool(8)
    both = threading.Barrier(2)
    seen: list[int] = []

    def borrow():
        with pool.lend() as staging:
            seen.append(id(staging))
            both.wait(5)

    threads = [threading.Thread(target=borrow) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 2
    with pool.lend() as again:
        assert id(again) in seen


def test_an_identity_model_returns_each_caller_its_own_rows_from_eight_threads():
    """A model that returns its input hands back views of the staging buffer: they must be
    copied out before the next batch overwrites them."""
    spec = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("x2", np.float32, [2]),), 16)
    runner = FunctionRunner(lambda i: {"x2": i["x"]}, spec)
    batcher = Batcher(runner, BatchingPolicy(max_queue_delay_us=500), instance_count=2, name="id")
    wrong: list[str] = []

    def client(c: int) -> None:
        for k in range(200):
            x = np.array([[c, k]], np.float32)
            y = batcher.infer_sync({"x": x}, wait_s=10)["x2"]
            if not np.array_equal(y, x):
                wrong.append(f"client {c} request {k}: {y.tolist()}")

    each_client(client)
    batcher.close()
    assert not wrong, wrong[:5]
    assert batcher.stats.execution_count < 1600  # it did batch


def _allocated_per_batch(batcher: Batcher, requests: list[np.ndarray], batches: int) -> int:
    async def one_batch() -> None:
        await asyncio.gather(*(batcher.infer({"x": x}) for x in requests))

    async def run(n: int) -> None:
        for _ in range(n):
            await one_batch()

    asyncio.run(run(5))  # warm: buffers allocated, threads started
    tracemalloc.start()
    try:
        asyncio.run(run(batches))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_a_steady_load_allocates_no_batch_sized_array():
    """Against a per-batch concatenation the peak holds at least one whole batch (1.5 MB)."""
    runner = FunctionRunner(mean_of_rows, SPEC)
    batcher = Batcher(runner, BatchingPolicy(max_queue_delay_us=100_000), name="steady")
    requests = [np.full((1, *IMAGE), i, np.float32) for i in range(32)]
    batch_bytes = sum(x.nbytes for x in requests)
    peak = _allocated_per_batch(batcher, requests, 10)
    batcher.close()
    assert batcher.stats.execution_count >= 15 and max(batcher.stats.batch_rows) == 32
    assert peak < batch_bytes / 4, f"peak {peak} B within steady batches of {batch_bytes} B"
    assert runner.staging.allocations == 1


def test_run_requests_gathers_into_the_runners_staging():
    """The path PyTriton, the Triton backend and Ray take: the same buffers batch after batch."""
    runner = FunctionRunner(mean_of_rows, SPEC)
    requests = [{"x": np.full((1, *IMAGE), i, np.float32)} for i in range(8)]
    for _ in range(3):
        results = run_requests(runner, requests)
        assert [float(r["y"][0, 0]) for r in results] == [float(i) for i in range(8)]
    assert runner.staging.allocations == 1


def test_a_closed_pool_refuses_a_batch_as_the_model_not_ready():
    """A batch after its runner closed gets a 503 saying why, not a crash on freed memory."""
    import pytest

    from servekit.errors import ModelNotReady

    pool = StagingPool(4)
    pool.close()
    with pytest.raises(ModelNotReady, match="staging buffers are freed"), pool.lend():
        pass
