"""The sequence batcher running a model (``batching.sequencer``): random interleavings of
sequences on both strategies give each sequence what a sequential run gives it, with
Triton's control values row by row and the implicit state carried from one request to
the next; the model is told when and why each sequence ends; bad requests are refused
naming their sequence."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cancelled_first
from servekit import BatchingPolicy, InvalidInput
from servekit.batching.sequence import Controls, SequenceFlags, SequencePolicy, StateSpec
from servekit.batching.sequencer import SequenceBatcher
from servekit.spec import ModelSpec, TensorSpec

SPEC = ModelSpec(
    inputs=(
        TensorSpec("INPUT", "FP32", [2]),
        TensorSpec("STATE_IN", "FP32", [2]),
        TensorSpec("START", "INT32", [1]),
        TensorSpec("END", "INT32", [1]),
        TensorSpec("READY", "INT32", [1]),
        TensorSpec("CORRID", "UINT64", [1]),
    ),
    outputs=(TensorSpec("OUTPUT", "FP32", [2]), TensorSpec("STATE_OUT", "FP32", [2])),
    max_batch_size=4,
)
CONTROLS = Controls(start="START", end="END", ready="READY", corrid="CORRID")


class Accumulator:
    """OUTPUT = INPUT + STATE_IN (the state servekit keeps); records each row's controls."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int]] = []  # (corrid, start, end, ready)
        self.ended: list[tuple[object, str]] = []
        self.lock = threading.Lock()

    def __call__(self, inputs):
        with self.lock:
            for i in range(len(inputs["INPUT"])):
                self.rows.append(
                    (int(inputs["CORRID"][i, 0]), int(inputs["START"][i, 0]),
                     int(inputs["END"][i, 0]), int(inputs["READY"][i, 0]))
                )  # fmt: skip
        total = inputs["INPUT"] + inputs["STATE_IN"]
        return {"OUTPUT": total, "STATE_OUT": total}


def batcher(model, strategy="direct", instances=1, max_batch=4, idle_us=1_000_000, **kw):
    policy = SequencePolicy(
        strategy=strategy,
        max_sequence_idle_us=idle_us,
        controls=CONTROLS,
        states=(StateSpec("STATE_IN", "STATE_OUT"),),
        **kw,
    )
    return SequenceBatcher(
        model, BatchingPolicy(max_batch_size=max_batch), policy, spec=SPEC, instance_count=instances
    )


def request(value: float) -> dict[str, np.ndarray]:
    return {"INPUT": np.full((1, 2), value, np.float32)}


def test_the_served_signature_leaves_out_the_controls_and_the_state():
    b = batcher(Accumulator())
    assert [t.name for t in b.spec.inputs] == ["INPUT"]
    assert [t.name for t in b.spec.outputs] == ["OUTPUT"]
    b.close()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=7),
    strategy=st.sampled_from(["direct", "oldest"]),
    instances=st.integers(1, 2),
    max_batch=st.integers(1, 4),
    data=st.data(),
)
def test_interleaved_sequences_get_what_a_sequential_run_gives(
    lengths, strategy, instances, max_batch, data
):
    values = {sid: [float(sid * 10 + i) for i in range(n)] for sid, n in enumerate(lengths, 1)}
    order = data.draw(
        st.permutations([sid for sid, n in enumerate(lengths, 1) for _ in range(n)])
    )  # each sequence's requests in order, the sequences interleaved at random
    model = Accumulator()
    b = batcher(model, strategy, instances, max_batch, max_candidate_sequences=2)

    async def run():
        sent = {sid: 0 for sid in values}
        calls = []
        for sid in order:
            i = sent[sid]
            sent[sid] += 1
            flags = SequenceFlags(sid, start=i == 0, end=i == len(values[sid]) - 1)
            calls.append(
                ((sid, i), asyncio.ensure_future(b.infer(request(values[sid][i]), sequence=flags)))
            )
            if data.draw(st.booleans()):
                await asyncio.sleep(0)
        return {key: (await call)["OUTPUT"] for key, call in calls}

    try:
        answers = asyncio.run(run())
    finally:
        b.close()
    for sid, vs in values.items():
        running = 0.0
        for i, v in enumerate(vs):
            running += v
            assert np.all(answers[(sid, i)] == running), (sid, i, answers[(sid, i)], running)
    real = [r for r in model.rows if r[3] == 1]
    assert sorted(r[0] for r in real) == sorted(order)  # each request ran once, READY 1
    for sid, vs in values.items():
        mine = [r for r in real if r[0] == sid]
        assert [r[1] for r in mine] == [1] + [0] * (len(vs) - 1)  # START on the first only
        assert [r[2] for r in mine] == [0] * (len(vs) - 1) + [1]  # END on the last only
    empty = [r for r in model.rows if r[3] == 0]
    assert strategy == "direct" or not empty  # READY 0 only in direct's held, idle slots
    assert all(r[:3] == (0, 0, 0) for r in empty)


def test_the_model_is_told_each_sequence_ended_and_why():
    model = Accumulator()
    model.end_sequence = lambda sid, reason: model.ended.append((sid, reason))
    b = batcher(model, idle_us=50_000)

    async def run():
        await b.infer(request(1), sequence=SequenceFlags(1, start=True, end=True))
        await b.infer(request(1), sequence=SequenceFlags(2, start=True))  # then idles
        await asyncio.sleep(0.2)
        with pytest.raises(InvalidInput, match="START flag"):  # idle: released
            await b.infer(request(1), sequence=SequenceFlags(2))

    try:
        asyncio.run(run())
    finally:
        b.close()
    assert model.ended == [(1, "end"), (2, "idle")]


def test_a_caller_that_leaves_cancels_its_sequence_and_frees_its_slot():
    gate = threading.Event()
    model = Accumulator()
    model.end_sequence = lambda sid, reason: model.ended.append((sid, reason))
    slow = lambda inputs: (gate.wait(10), model(inputs))[1]  # noqa: E731
    slow.end_sequence = model.end_sequence
    b = SequenceBatcher(
        slow, BatchingPolicy(max_batch_size=1),
        SequencePolicy(controls=CONTROLS, states=(StateSpec("STATE_IN", "STATE_OUT"),)),
        spec=SPEC,
    )  # fmt: skip

    async def run():
        first = asyncio.ensure_future(b.infer(request(1), sequence=SequenceFlags(1, start=True)))
        waiting = asyncio.ensure_future(b.infer(request(2), sequence=SequenceFlags(1)))
        backlog = asyncio.ensure_future(
            b.infer(request(5), sequence=SequenceFlags(2, start=True, end=True))
        )
        await asyncio.sleep(0.05)
        waiting.cancel()  # sequence 1 is released: its slot goes to sequence 2
        gate.set()
        assert (await backlog)["OUTPUT"][0, 0] == 5.0
        assert (await first)["OUTPUT"][0, 0] == 1.0

    try:
        asyncio.run(run())
    finally:
        b.close()
    assert (1, "cancelled") in model.ended and (2, "end") in model.ended


@pytest.mark.parametrize(
    "flags, inputs, words",
    [
        (None, request(1), "must carry sequence_id"),
        (SequenceFlags(0, start=True), request(1), "non-zero"),
        (SequenceFlags(9), request(1), "START flag on the first request"),
        (SequenceFlags("abc", start=True), request(1), "is a string"),
        (SequenceFlags(3, start=True), {"INPUT": np.ones((2, 2), np.float32)}, "one row"),
        (SequenceFlags(3, start=True), {"INPUT": np.ones((1, 3), np.float32)}, "INPUT"),
    ],
)
def test_bad_requests_are_refused_naming_what_was_wrong(flags, inputs, words):
    b = batcher(Accumulator())

    async def run():
        with pytest.raises(InvalidInput, match=words):
            await b.infer(inputs, sequence=flags)
        await b.infer(request(1), sequence=SequenceFlags(4, start=True, end=True))  # goes on

    try:
        asyncio.run(run())
    finally:
        b.close()


def test_a_policy_naming_what_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match="control 'NOPE'"):
        SequenceBatcher(
            Accumulator(), BatchingPolicy(), SequencePolicy(controls=Controls(start="NOPE")),
            spec=SPEC,
        )  # fmt: skip
    with pytest.raises(ValueError, match="state 'INPUT' -> 'MISSING'"):
        SequenceBatcher(
            Accumulator(), BatchingPolicy(),
            SequencePolicy(states=(StateSpec("INPUT", "MISSING"),)), spec=SPEC,
        )  # fmt: skip


def test_a_call_cancelled_under_a_coroutine_sequence_batch_fails_it_and_serves_on():
    """As the Batcher's: a call the batch awaited cancelled by its owner fails the batch
    (its requests get a ``RunnerError``), and the next batch is run."""
    from servekit import RunnerError

    owned_elsewhere = cancelled_first(Accumulator())

    b = batcher(owned_elsewhere)

    async def run():
        with pytest.raises(RunnerError, match="cancelled under it"):
            await asyncio.wait_for(b.infer(request(1), sequence=SequenceFlags(1, start=True)), 10)
        flags = SequenceFlags(2, start=True, end=True)
        return await asyncio.wait_for(b.infer(request(2), sequence=flags), 10)

    try:
        assert asyncio.run(run())["OUTPUT"][0, 0] == 2
    finally:
        b.close()
