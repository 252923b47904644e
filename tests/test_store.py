"""The model store's core: which models are resident under a memory budget, on-demand
loads shared by every request waiting for them, LRU eviction of idle unpinned models,
unloads that wait for the requests holding a model, and refusals that name the figures.

Models are real (add_sub on ONNX Runtime); what each load adds to memory is set by the
test through ``measure``, so the budget's arithmetic is exact here. The served store,
with RSS measured for real, is in test_store_served.py."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit import ModelConfig
from servekit.errors import ModelNotFound, ModelNotReady, Overloaded
from servekit.runtime.base import ServedModel
from servekit.store import ModelStore
from servekit.store.unit import load_served as _load

MB = 1024 * 1024
X = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}


class Memory:
    """What the store measures: each load adds ``sizes[name]`` MB; unloads free it."""

    def __init__(self, sizes: dict[str, float]) -> None:
        self.sizes, self.used, self.loads = sizes, 0, []

    def measure(self) -> int:
        return self.used

    def loader(self, config: ModelConfig) -> list[ServedModel]:
        served = _load(config, None, None)
        self.loads.append(config.name)
        self.used += int(self.sizes[config.name] * MB)
        return served


class FixedMeter:
    """A meter that knows each model's cost before it loads."""

    def __init__(self, sizes: dict[str, float]) -> None:
        self.sizes, self.asked = sizes, []

    def charge(self, config: ModelConfig, path: str | None) -> int:
        self.asked.append(config.name)
        return int(self.sizes[config.name] * MB)

    def close(self) -> None:
        pass


def make_store(
    add_sub_path, names, *, budget_mb=0.0, sizes=None, **kwargs
) -> tuple[ModelStore, Memory]:
    memory = Memory({n: (sizes or {}).get(n, 10.0) for n in names})
    models = {n: ModelConfig(str(add_sub_path), n, image=False) for n in names}
    store = ModelStore(
        models, budget_bytes=int(budget_mb * MB), loader=memory.loader,
        measure=memory.measure, prime=False, **kwargs,
    )  # fmt: skip
    return store, memory


async def hold(store: ModelStore, name: str, until: asyncio.Event) -> None:
    """A request that holds ``name`` until ``until`` is set."""
    async with store.lease(name):
        await until.wait()


async def answer(store: ModelStore, name: str) -> np.ndarray:
    async with store.lease(name) as batcher:
        return (await batcher.infer(X))["OUTPUT0"]


@settings(max_examples=25, deadline=None)
@given(trace=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=30))
def test_evictions_follow_the_least_recently_used_order_the_trace_implies(add_sub_path, trace):
    store, _ = make_store(add_sub_path, list("abcdef"), budget_mb=30)

    async def run() -> list[str]:
        for name in trace:
            assert (await answer(store, name)).tolist() == [[2.0] * 16]
        evicted = [e["model"] for e in store.events if e["event"] == "evict"]
        await store.close()
        return evicted

    expected, resident = [], []  # the reference: a list in order of last use
    for name in trace:
        if name in resident:
            resident.remove(name)
        elif len(resident) == 3:
            expected.append(resident.pop(0))
        resident.append(name)
    assert asyncio.run(run()) == expected


def test_a_flood_of_first_requests_to_a_cold_model_causes_one_load(add_sub_path):
    store, memory = make_store(add_sub_path, ["cold"])

    async def run() -> list[np.ndarray]:
        answers = await asyncio.gather(*(answer(store, "cold") for _ in range(50)))
        await store.close()
        return answers

    assert all(a.tolist() == [[2.0] * 16] for a in asyncio.run(run()))
    assert memory.loads == ["cold"]


def test_pinned_models_are_loaded_at_start_and_never_evicted(add_sub_path):
    store, memory = make_store(add_sub_path, list("pabc"), budget_mb=30, pin=["p"])

    async def run() -> None:
        await store.start()
        assert memory.loads == ["p"]
        for name in "abcabc":
            await answer(store, name)
        assert store.state("p") == "READY"
        assert sorted(store.resident()) == ["b", "c", "p"]  # 30 MB: the pin and the last two
        await store.close()

    asyncio.run(run())
    assert "p" not in [e["model"] for e in store.events if e["event"] == "evict"]


def test_an_unload_waits_for_the_requests_holding_the_model(add_sub_path):
    store, _ = make_store(add_sub_path, ["m"])
    held = threading.Event()

    async def run() -> list[str]:
        seen = []
        async with store.lease("m"):
            held.set()
            unload = asyncio.create_task(store.unload("m"))
            await asyncio.sleep(0.05)
            seen.append(store.state("m"))  # still holding it: the unload waits
            assert not unload.done()
        await unload
        seen.append(store.state("m"))
        assert (await answer(store, "m")).tolist() == [[2.0] * 16]  # loads again on demand
        seen.append(store.state("m"))
        await store.close()
        return seen

    assert asyncio.run(run()) == ["UNLOADING", "UNAVAILABLE", "READY"]


def test_a_model_larger_than_the_whole_budget_is_refused_with_the_figures(add_sub_path):
    store, memory = make_store(add_sub_path, ["big"], budget_mb=5, sizes={"big": 8})

    async def run() -> None:
        with pytest.raises(
            ModelNotReady,
            match=r"'big' takes 8.0 MB resident \(measured after its load and warm-up\), "
            r"more than the whole budget of 5.0 MB",
        ):
            await answer(store, "big")
        assert store.resident() == {}
        assert "load failed" in store.index()[0]["reason"]
        with pytest.raises(ModelNotReady, match=r"takes 8.0 MB resident .* more than the whole"):
            await answer(store, "big")  # its size is known now: refused before loading
        assert memory.loads == ["big"]
        await store.close()

    asyncio.run(run())


def test_a_budget_held_by_models_in_use_refuses_a_load_after_wait_s(add_sub_path):
    store, _ = make_store(add_sub_path, ["a", "b"], budget_mb=15, wait_s=0.2)

    async def run() -> None:
        async with store.lease("a"):
            started = time.monotonic()
            with pytest.raises(Overloaded, match=r"'b' .* held by models in use or pinned") as e:
                await answer(store, "b")
            assert 0.2 <= time.monotonic() - started < 2
            assert e.value.retry_after_s == 1.0 and "'a': 10.0" in str(e.value)
            assert store.totals()["refusals"] == 1
        assert (await answer(store, "b")).tolist() == [[2.0] * 16]  # a is idle now: evicted
        assert list(store.resident()) == ["b"]
        await store.close()

    asyncio.run(run())


def test_a_failed_load_reaches_every_waiter_and_the_next_request_tries_again(
    add_sub_path, tmp_path
):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    models = {"m": ModelConfig(str(broken), "m", image=False)}
    store = ModelStore(models, prime=False)

    async def run() -> None:
        results = await asyncio.gather(
            *(answer(store, "m") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, ValueError) and "broken.onnx" in str(r) for r in results)
        (row,) = store.index()
        assert row["state"] == "UNAVAILABLE" and "broken.onnx: cannot load" in row["reason"]
        broken.write_bytes(add_sub_path.read_bytes())
        assert (await answer(store, "m")).tolist() == [[2.0] * 16]
        await store.close()

    asyncio.run(run())


def test_an_unknown_model_is_not_found_and_eager_stores_never_load_on_request(add_sub_path):
    store, memory = make_store(add_sub_path, ["a", "b"], on_demand=False)

    async def run() -> None:
        with pytest.raises(ModelNotFound, match="unknown model 'zzz'"):
            await answer(store, "zzz")
        await store.start()
        assert memory.loads == ["a", "b"]
        await store.unload("a")
        with pytest.raises(
            ModelNotReady, match=r"'a' is not loaded .*/v2/repository/models/a/load"
        ):
            await answer(store, "a")
        await store.load("a")
        assert (await answer(store, "a")).tolist() == [[2.0] * 16]
        await store.close()

    asyncio.run(run())


def test_the_first_load_is_done_twice_so_no_model_is_charged_the_engine_s_start(add_sub_path):
    memory = Memory({"a": 10.0, "b": 10.0})
    first = [True]

    def loader(config: ModelConfig) -> list[ServedModel]:
        if first[0]:  # the engine's one-time start: 30 MB that no model holds
            memory.used += 30 * MB
            first[0] = False
        return memory.loader(config)

    models = {n: ModelConfig(str(add_sub_path), n, image=False) for n in "ab"}
    store = ModelStore(models, budget_bytes=25 * MB, loader=loader, measure=memory.measure)

    async def run() -> dict[str, int]:
        await answer(store, "a")
        await answer(store, "b")
        charges = {n: r.charged for n, r in store.resident().items()}
        await store.close()
        return charges

    assert asyncio.run(run()) == {"a": 10 * MB, "b": 10 * MB}
    assert memory.loads == ["a", "a", "b"]


def test_a_caller_that_goes_away_does_not_cancel_a_load_others_wait_for(add_sub_path):
    store, memory = make_store(add_sub_path, ["m"])
    gate = threading.Event()
    load = memory.loader

    def slow(config: ModelConfig) -> list[ServedModel]:
        gate.wait(10)
        return load(config)

    store._loader = slow

    async def run() -> np.ndarray:
        first = asyncio.create_task(answer(store, "m"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(answer(store, "m"))
        await asyncio.sleep(0.05)
        first.cancel()  # its client went away mid-load
        await asyncio.sleep(0.05)
        gate.set()
        out = await second
        assert first.cancelled() and store.state("m") == "READY"
        await store.close()
        return out

    assert asyncio.run(run()).tolist() == [[2.0] * 16]
    assert memory.loads == ["m"]


def test_the_charge_follows_memory_the_process_really_takes_and_gives_back():
    """64 MB of touched host memory shows in the store's measure and leaves it once freed
    and handed back to the system; the GPU tests below do the same for device memory."""
    from servekit.store import resident_bytes
    from servekit.store.memory import release_freed

    before = resident_bytes()
    block = np.ones(64 * MB, np.uint8)  # touched: resident, not just reserved
    grown = resident_bytes() - before
    del block
    release_freed()  # as the store does after each unload: the allocator gives it back
    shrunk = resident_bytes() - before
    assert 60 * MB <= grown <= 72 * MB, grown / MB
    assert shrunk <= 8 * MB, shrunk / MB


def _cudart():
    """cuda-python's runtime API with a CUDA device behind it, or a skip saying what is missing."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py")
    cudart = pytest.importorskip("cuda.cudart", reason="needs cuda-python")
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        pytest.skip("no CUDA device")
    return cudart


@pytest.mark.gpu
def test_device_memory_a_load_allocates_is_charged():
    cudart = _cudart()
    from servekit.store import device_bytes

    cudart.cudaFree(0)  # the context first: its own memory is not the allocation's
    before = device_bytes()
    err, ptr = cudart.cudaMalloc(256 * MB)
    assert err == cudart.cudaError_t.cudaSuccess
    try:
        assert device_bytes() - before >= 256 * MB
    finally:
        cudart.cudaFree(ptr)


@pytest.mark.gpu
def test_a_budget_counts_device_memory_and_eviction_gives_it_back(add_sub_path):
    """Each load holds 512 MB of device memory besides its ONNX model: the store's own
    measure (RSS plus NVML's per-process figure) charges it, a budget of two such models
    evicts the least recently used for a third, and the eviction frees the device memory."""
    cudart = _cudart()
    from servekit.store import device_bytes

    block = 512 * MB
    held: list[int] = []

    def loader(config: ModelConfig) -> list[ServedModel]:
        served = _load(config, None, None)
        err, ptr = cudart.cudaMalloc(block)
        assert err == cudart.cudaError_t.cudaSuccess
        held.append(ptr)
        runner, close = served[0].runner, served[0].runner.close

        def close_and_free() -> None:
            close()
            cudart.cudaFree(ptr)
            held.remove(ptr)

        runner.close = close_and_free  # type: ignore[method-assign]
        return served

    models = {n: ModelConfig(str(add_sub_path), n, image=False) for n in "abc"}
    store = ModelStore(models, budget_bytes=int(2.6 * block), loader=loader)

    async def run() -> tuple[list[int], int, int]:
        await answer(store, "a")
        await answer(store, "b")
        charges = [r.charged for r in store.resident().values()]
        before = device_bytes()
        await answer(store, "c")
        after = device_bytes()
        await store.close()
        return charges, before, after

    charges, before, after = asyncio.run(run())
    assert all(c >= block for c in charges), charges
    assert [e["model"] for e in store.events if e["event"] == "evict"] == ["a"]
    assert abs(after - before) < block // 2  # a's block went back before c's was taken
    assert held == []


# ------------------------------------------------------------ progress under any load


@settings(max_examples=15, deadline=None)
@given(
    wanted=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=40),
    room=st.integers(1, 3),
)
def test_every_load_serves_a_request_however_many_clients_share_a_small_budget(
    add_sub_path, wanted, room
):
    # All requests at once, more models than the budget holds: the livelock was a load
    # evicted by the next one before its waiters ran, loaded again, for ever.
    store, memory = make_store(add_sub_path, list("abcdef"), budget_mb=10 * room + 5)
    served_by: list[int] = []

    async def one(name: str) -> None:
        async with store.lease(name) as batcher:
            served_by.append(id(batcher))
            assert (await batcher.infer(X))["OUTPUT0"].tolist() == [[2.0] * 16]

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(*(one(n) for n in wanted)), 30)
        assert store.resident_bytes <= store.budget
        await store.close()

    asyncio.run(run())
    # Each load's Batcher answered at least one request: no load was wasted.
    assert len(set(served_by)) == len(memory.loads) <= len(wanted)


def test_a_load_that_no_request_waits_for_by_its_turn_is_dropped(add_sub_path):
    meter = FixedMeter({"a": 10.0, "b": 10.0})
    store, memory = make_store(add_sub_path, ["a", "b"], budget_mb=15, wait_s=0.2, meter=meter)

    async def run() -> None:
        async with store.lease("a"):
            with pytest.raises(Overloaded):
                await answer(store, "b")
            await asyncio.sleep(0.3)  # b's load waited for room, then nobody wanted it
        assert store.state("b") == "UNAVAILABLE"
        assert store.index()[1]["reason"] == "load dropped: no request waited for it"
        assert store.totals()["dropped"] == 1 and memory.loads == ["a"]
        await store.close()

    asyncio.run(run())


def test_a_request_waiting_for_room_gets_it_when_a_model_comes_free(add_sub_path):
    store, memory = make_store(add_sub_path, ["a", "b"], budget_mb=15, wait_s=5)

    async def run() -> None:
        release = asyncio.Event()
        holder = asyncio.ensure_future(hold(store, "a", release))
        await asyncio.sleep(0.05)
        b = asyncio.ensure_future(answer(store, "b"))
        await asyncio.sleep(0.1)
        assert not b.done() and store.index()[1]["waiting"] == 1
        release.set()
        assert (await b).tolist() == [[2.0] * 16]
        await holder
        assert memory.loads == ["a", "b"] and list(store.resident()) == ["b"]
        await store.close()

    asyncio.run(run())


def test_close_drops_queued_loads_and_leaves_no_task_behind(add_sub_path):
    meter = FixedMeter(dict.fromkeys("abcde", 10.0))
    store, memory = make_store(add_sub_path, list("abcde"), budget_mb=15, wait_s=30, meter=meter)

    async def run() -> None:
        holder = asyncio.Event()
        held = asyncio.ensure_future(hold(store, "a", holder))
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(answer(store, n)) for n in "bcde"]
        await asyncio.sleep(0.1)
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.1)
        holder.set()
        await asyncio.wait_for(closing, 5)
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, ModelNotReady) and "stopping" in str(r) for r in results), results
        await held
        assert memory.loads == ["a"] and store.resident() == {}
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(run())


def test_loads_are_paced_to_max_loads_per_s(add_sub_path):
    store, memory = make_store(add_sub_path, list("abcde"), max_loads_per_s=20)

    async def run() -> float:
        started = time.monotonic()
        for name in "abcde":
            await answer(store, name)
        took = time.monotonic() - started
        await store.close()
        return took

    assert asyncio.run(run()) >= 4 / 20 and memory.loads == list("abcde")


def test_a_charge_measured_in_place_is_the_median_of_the_last_loads_never_a_ratchet(
    add_sub_path,
):
    readings = iter([10, 40, 10, 12, 11])

    class Noisy(Memory):
        def loader(self, config: ModelConfig) -> list[ServedModel]:
            self.sizes[config.name] = next(readings)
            return super().loader(config)

    memory = Noisy({"a": 0.0})
    store = ModelStore(
        {"a": ModelConfig(str(add_sub_path), "a", image=False)},
        loader=memory.loader, measure=memory.measure, prime=False,
    )  # fmt: skip

    async def run() -> list[float]:
        charges = []
        for _ in range(5):
            await answer(store, "a")
            charges.append(store.resident()["a"].charged / MB)
            await store.unload("a")
            memory.used = 0
        await store.close()
        return charges

    # medians of (10), (10, 40), (10, 40, 10), (40, 10, 12), (10, 12, 11)
    assert asyncio.run(run()) == [10, 25, 10, 12, 11]


def test_a_metered_charge_is_known_before_the_load_so_the_budget_is_never_passed(add_sub_path):
    # The loads themselves read 30 MB each (what other requests allocated meanwhile);
    # the meter says 10: the charge is the meter's, asked once per model.
    sizes = {n: 10.0 for n in "abcd"}
    memory = Memory({n: 30.0 for n in "abcd"})
    meter = FixedMeter(sizes)
    store = ModelStore(
        {n: ModelConfig(str(add_sub_path), n, image=False) for n in "abcd"},
        budget_bytes=25 * MB, loader=memory.loader, measure=memory.measure, prime=False,
        meter=meter,  # type: ignore[arg-type]
    )  # fmt: skip

    async def run() -> None:
        for name in "abcdab":
            await answer(store, name)
            assert store.resident_bytes <= 25 * MB
            assert all(r.charged == 10 * MB for r in store.resident().values())
        assert len(store.resident()) == 2
        await store.close()

    asyncio.run(run())
    assert meter.asked == list("abcd")
