"""The response cache's core (``servekit.cache``): what makes two requests the same one,
the check that keeps a collision from returning a wrong answer, the byte-bounded LRU,
counts that add up, and a Redis shared by two replicas that may die mid-load."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit.cache import LocalStore, Query, ResponseCache, decode_tensors, encode_tensors

BASE = np.arange(12, dtype=np.float32)


def variants() -> dict[str, Query]:
    """Queries whose input bytes are all the same 48 bytes, each differing from the
    first in one thing that changes the answer."""
    flat = BASE.reshape(12)

    def q(**change: object) -> Query:
        args: dict = {
            "model": "m", "version": "1", "identity": "sha:abc",
            "inputs": {"x": flat}, "parameters": {}, "outputs": (),
        } | change  # fmt: skip
        return Query.of(**args)

    return {
        "base": q(),
        "shape": q(inputs={"x": flat.reshape(3, 4)}),
        "other shape": q(inputs={"x": flat.reshape(4, 3)}),
        "datatype": q(inputs={"x": flat.view(np.int32)}),
        "name": q(inputs={"y": flat}),
        "split in two": q(inputs={"x": flat[:6], "y": flat[6:]}),
        "parameters": q(parameters={"top_k": 3}),
        "outputs": q(outputs=("probs",)),
        "version": q(version="2"),
        "identity": q(identity="sha:def"),
        "model": q(model="n"),
    }


def test_requests_equal_in_bytes_but_not_in_meaning_never_share_an_answer():
    cache = ResponseCache(LocalStore(1 << 20))
    queries = variants()
    assert len({q.key() for q in queries.values()}) == len(queries)

    async def run() -> None:
        for k, q in enumerate(queries.values()):
            assert await cache.lookup(q) is None
            await cache.insert(q, {"y": np.full(2, k, np.float32)})
        for k, q in enumerate(queries.values()):
            answer = await cache.lookup(q)
            assert answer is not None and answer["y"].tolist() == [k, k]

    asyncio.run(run())


tensors = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.builds(
        lambda dtype, shape, seed: (
            np.random.default_rng(seed).integers(0, 256, size=shape).astype(dtype)
        ),
        st.sampled_from(["float32", "int64", "uint8", "float16", "bool"]),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
        st.integers(0, 2**32 - 1),
    ),
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(tensors, tensors)
def test_two_queries_share_an_encoding_only_when_every_tensor_is_the_same(a, b):
    def same(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(
            x[k].dtype == y[k].dtype
            and x[k].shape == y[k].shape
            and x[k].tobytes() == y[k].tobytes()
            for k in x
        )

    qa, qb = (Query.of("m", "1", "i", t) for t in (a, b))
    assert (qa.encode() == qb.encode()) == same(a, b)
    back = decode_tensors(encode_tensors(a))
    assert same(back, a)


def test_bytes_tensors_round_trip_and_count_each_element():
    words = np.array([b"ab", b"c"], dtype=np.object_)
    back = decode_tensors(encode_tensors({"t": words}))["t"]
    assert back.dtype == np.object_ and back.tolist() == [b"ab", b"c"]
    joined = np.array([b"a", b"bc"], dtype=np.object_)  # the same bytes, cut elsewhere
    assert encode_tensors({"t": words}) != encode_tensors({"t": joined})


class OneSlot(LocalStore):
    """A store whose every key is the same slot: a hash that always collides."""

    async def get(self, key: str) -> bytes | None:
        return await super().get("m/1/same")

    async def put(self, key: str, entry: bytes) -> None:
        await super().put("m/1/same", entry)


def test_a_collision_is_a_miss_never_another_requests_answer():
    cache = ResponseCache(OneSlot(1 << 20))
    first, second = variants()["base"], variants()["shape"]

    async def run() -> None:
        await cache.insert(first, {"y": np.zeros(1, np.float32)})
        assert await cache.lookup(second) is None  # the slot holds the first's answer
        assert (await cache.lookup(first))["y"].tolist() == [0.0]

    asyncio.run(run())
    figures = {name: samples for name, _, _, samples in cache.figures()}
    assert figures["servekit_cache_collisions_total"] == [({"model": "m"}, 1.0)]


def test_an_entry_that_does_not_decode_is_a_miss_not_an_error():
    store = LocalStore(1 << 20)
    cache = ResponseCache(store)
    query = variants()["base"]

    async def run() -> None:
        for junk in (b"", b"\x01", b"\xff" * 8 + b"x", b"\x00" * 7):
            await store.put(query.key(), junk)
            assert await cache.lookup(query) is None

    asyncio.run(run())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 300)), max_size=60))
def test_the_local_store_stays_within_its_bytes_and_keeps_the_most_recent(puts):
    store = LocalStore(1000)

    async def run() -> None:
        for key, size in puts:
            await store.put(f"m/1/{key}", b"x" * size)
            assert store.size_bytes() <= 1000
            assert await store.get(f"m/1/{key}") == b"x" * size  # the newest is kept

    asyncio.run(run())


def test_hits_and_misses_add_up_to_the_lookups_per_model():
    cache = ResponseCache(LocalStore(1 << 20))
    rng = np.random.default_rng(0)
    draws = rng.integers(0, 5, size=200)

    async def run() -> None:
        for d in draws:
            q = Query.of("m" if d % 2 else "n", "1", "i", {"x": np.full(2, d, np.float32)})
            if await cache.lookup(q) is None:
                await cache.insert(q, {"y": np.full(1, d, np.float32)})

    asyncio.run(run())
    figures = {
        name: dict((s["model"], v) for s, v in samples) for name, _, _, samples in cache.figures()
    }
    hits, misses = figures["nv_cache_num_hits_per_model"], figures["nv_cache_num_misses_per_model"]
    for model, odd in (("m", True), ("n", False)):
        lookups = sum(1 for d in draws if bool(d % 2) == odd)
        distinct = len({int(d) for d in draws if bool(d % 2) == odd})
        assert hits[model] + misses[model] == lookups
        assert misses[model] == distinct
    assert figures["nv_cache_hit_duration_per_model"]["m"] > 0


def test_invalidating_a_model_forgets_its_answers_only():
    cache = ResponseCache(LocalStore(1 << 20))
    a = Query.of("a", "1", "i", {"x": BASE})
    b = Query.of("b", "1", "i", {"x": BASE})

    async def run() -> None:
        for q in (a, b):
            await cache.insert(q, {"y": BASE})
        assert await cache.invalidate("a") == 1
        assert await cache.lookup(a) is None
        assert await cache.lookup(b) is not None

    asyncio.run(run())


# ------------------------------------------------------------- Redis, a real one


def test_two_replicas_share_answers_through_redis_and_serve_on_while_it_is_down(
    redis_server, caplog
):
    from servekit.cache import RedisStore

    url, stop, start = redis_server
    caplog.set_level(logging.WARNING, logger="servekit")

    async def run() -> None:
        one = ResponseCache(RedisStore(url, retry_s=0.2))
        two = ResponseCache(RedisStore(url, retry_s=0.2))
        queries = [Query.of("m", "1", "i", {"x": np.full(3, k, np.float32)}) for k in range(20)]
        for k, q in enumerate(queries):
            await one.insert(q, {"y": np.full(1, k, np.float32)})
        for k, q in enumerate(queries):  # the other replica finds what the first kept
            assert (await two.lookup(q))["y"].tolist() == [k]
        stop()
        began = time.monotonic()
        for q in queries:  # Redis gone: every lookup misses, none raises
            assert await two.lookup(q) is None
            await two.insert(q, {"y": np.zeros(1, np.float32)})
        assert time.monotonic() - began < 5  # a dead Redis is not waited on per request
        start()
        await asyncio.sleep(0.3)  # past retry_s: the next call tries Redis again
        await two.insert(queries[0], {"y": np.full(1, 7, np.float32)})
        assert (await one.lookup(queries[0]))["y"].tolist() == [7]
        for cache in (one, two):
            await cache.store.aclose()

    asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if "response cache" in r.getMessage()]
    assert sum("does not answer" in m for m in said) == 1, said  # said once, not per request
    assert any("answers again" in m for m in said), said


def test_a_redis_that_resets_every_connection_is_a_miss_on_the_servers_loop(caplog):
    """A Redis killed under load resets connections it had just accepted; on uvloop (the
    loop servekit's servers run on) writing to one raises RuntimeError, not OSError. That
    too is a miss, said once, never a failed request."""
    import socket
    import struct
    import threading

    from servekit.cache import RedisStore
    from servekit.http.h1 import new_loop

    caplog.set_level(logging.WARNING, logger="servekit")
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    port = listener.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: an RST, as from a killed peer

    threading.Thread(target=reset_each, daemon=True).start()

    async def run() -> None:
        cache = ResponseCache(RedisStore(f"redis://127.0.0.1:{port}/0", retry_s=0))
        queries = [Query.of("m", "1", "i", {"x": np.full(3, k, np.float32)}) for k in range(8)]
        for _ in range(20):  # 8 at once, as 8 clients' requests would be
            assert await asyncio.gather(*(cache.lookup(q) for q in queries)) == [None] * 8
            await asyncio.gather(
                *(cache.insert(q, {"y": np.zeros(1, np.float32)}) for q in queries)
            )
        await cache.store.aclose()

    loop = new_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
        listener.close()
    said = [r.getMessage() for r in caplog.records if "response cache" in r.getMessage()]
    assert sum("does not answer" in m for m in said) == 1, said
