"""The sequence batcher in front of any Runner: ``sequence.SequenceSchedule`` decides,
this runs the batches, one thread per instance, and keeps each sequence's state.

Each batch gets Triton's control inputs (START, END, READY, CORRID, in the dtypes the
model declares) and its implicit state (each state input fed the output the sequence's
previous request made, zeros at START), and its callers get the outputs the served
signature names; neither the controls nor the state are in it, so clients send only
the real inputs. A model with a method ``end_sequence(sequence_id, reason)`` is told
when a sequence ends and why (``end``, ``idle``, ``cancelled``), on the instance that
ran it, after its last batch, so it can free what it keeps for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import InvalidInput, ModelNotReady, ServekitError
from ..runners.base import Runner, batch_function
from ..spec import ModelSpec, TensorSpec
from .execute import as_error, awaited, detached
from .policy import BatchingPolicy
from .sequence import Ended, SequenceBatch, SequenceFlags, SequencePolicy, SequenceSchedule
from .stats import BatcherStats, BatchRecord

__all__ = ["Row", "SequenceBatcher", "SequenceState", "served_spec"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


def served_spec(spec: ModelSpec, sequence: SequencePolicy, name: str = "model") -> ModelSpec:
    """The signature clients see: ``spec`` without the control inputs and the state
    tensors; ``ValueError`` naming what the policy names that ``spec`` lacks or that
    cannot work (a control of more than one value, a state whose input and output differ,
    a dimension that is not fixed)."""
    inputs = {t.name: t for t in spec.inputs}
    outputs = {t.name: t for t in spec.outputs}
    for control in sequence.controls.names():
        if control not in inputs:
            raise ValueError(f"{name}: control {control!r} is not an input of the model")
        if inputs[control].shape not in ((1,), ()):
            raise ValueError(
                f"{name}: control {control!r} must be one value per row, "
                f"got {inputs[control].describe()}"
            )
    for state in sequence.states:
        if state.input not in inputs or state.output not in outputs:
            raise ValueError(
                f"{name}: state {state.input!r} -> {state.output!r} needs input "
                f"{state.input!r} and output {state.output!r} in the model"
            )
        given, made = inputs[state.input], outputs[state.output]
        if given.dtype != made.dtype or given.shape != made.shape:
            raise ValueError(
                f"{name}: state input {given.describe()} and output {made.describe()} differ"
            )
    hidden = set(sequence.controls.names()) | {s.input for s in sequence.states}
    served = [t for t in spec.inputs if t.name not in hidden]
    for t in served + [inputs[s.input] for s in sequence.states]:
        if -1 in t.shape:
            raise ValueError(
                f"{name}: a sequence model's tensors need fixed dims (its batches hold "
                f"rows of different sequences), got {t.describe()}"
            )
    return ModelSpec(
        tuple(served),
        tuple(t for t in spec.outputs if t.name not in {s.output for s in sequence.states}),
        spec.max_batch_size,
    )


def _filled(tensor: TensorSpec, rows: int, value: Any = 0) -> np.ndarray:
    shape = (rows, *tensor.shape)
    if tensor.dtype.datatype == "BYTES":
        return np.full(shape, value if isinstance(value, bytes) else b"", dtype=object)
    return np.full(shape, value, dtype=tensor.dtype.numpy)


Row = tuple[SequenceFlags, Mapping[str, np.ndarray]] | None
"""One row of a sequence batch: a request's flags and inputs, or None (a held slot with
nothing to run: READY 0)."""


class SequenceState:
    """What every sequence batch needs beside the requests' own inputs, for a model of
    ``spec`` under ``sequence``: Triton's control values and each sequence's implicit
    state, kept from one request to the next. ``SequenceBatcher`` uses it, and so does the
    servekit Triton backend under tritonserver's own sequence batcher."""

    def __init__(self, spec: ModelSpec, sequence: SequencePolicy, name: str = "model") -> None:
        self.spec, self.sequence = spec, sequence
        self.served = served_spec(spec, sequence, name)
        self._inputs = {t.name: t for t in spec.inputs}
        self._kept: dict[Any, Arrays] = {}

    def inputs(self, rows: list[Row]) -> Arrays:
        """The batch's tensors: each row's inputs (zeros for an empty one), the controls,
        and each sequence's state (zeros at START)."""
        n = len(rows)
        out: Arrays = {}
        for tensor in self.served.inputs:
            parts = [row[1][tensor.name] if row is not None else _filled(tensor, 1) for row in rows]
            out[tensor.name] = parts[0] if n == 1 else np.concatenate(parts)
        controls = self.sequence.controls
        for name, value in (
            (controls.start, lambda f: int(f.start)),
            (controls.end, lambda f: int(f.end)),
            (controls.ready, lambda f: 1),
            (controls.corrid, lambda f: f.id),
        ):
            if name is None:
                continue
            tensor = self._inputs[name]
            column = _filled(tensor, n)
            for i, row in enumerate(rows):
                if row is not None:
                    v = value(row[0])
                    column[i] = str(v).encode() if tensor.dtype.datatype == "BYTES" else v
            out[name] = column
        for state in self.sequence.states:
            tensor = self._inputs[state.input]
            column = _filled(tensor, n)
            for i, row in enumerate(rows):
                if row is None or row[0].start:
                    continue
                kept = self._kept.get(row[0].id)
                if kept is not None:
                    column[i] = kept[state.input][0]
            out[state.input] = column
        return out

    def outputs(
        self,
        rows: list[Row],
        outputs: Mapping[str, np.ndarray],
        keep: Callable[[SequenceFlags], bool] = lambda _: True,
    ) -> list[Arrays | None]:
        """Each row's served outputs (None for an empty row), keeping each sequence's state
        outputs for its next request (dropped at its END; not kept where ``keep`` says no:
        a sequence released while its request ran)."""
        answers: list[Arrays | None] = []
        for i, row in enumerate(rows):
            if row is None:
                answers.append(None)
                continue
            flags = row[0]
            if self.sequence.states and keep(flags):
                if flags.end:
                    self._kept.pop(flags.id, None)
                else:
                    self._kept[flags.id] = {
                        s.input: outputs[s.output][i : i + 1].copy() for s in self.sequence.states
                    }
            answers.append({t.name: outputs[t.name][i : i + 1] for t in self.served.outputs})
        return answers

    def drop(self, sequence_id: Any) -> None:
        """Forget a sequence's state (it ended)."""
        self._kept.pop(sequence_id, None)


class SequenceBatcher:
    """Triton's sequence batcher for a Runner (or a batch function with ``spec``):
    ``await infer(inputs, sequence=SequenceFlags(id, start, end))``.

    Args:
        policy: the batching policy (``max_batch_size``; the delay is ``sequence``'s).
        sequence: strategy, idle release, controls and implicit state.
        instance_count: instances; each runs one batch at a time, on a thread of its own.
        clock: monotonic seconds (every delay and idle time is on it).
        listeners: called with a ``BatchRecord`` after each batch (metrics).
    """

    def __init__(
        self,
        runner: Any,
        policy: BatchingPolicy,
        sequence: SequencePolicy,
        *,
        spec: ModelSpec | None = None,
        instance_count: int = 1,
        clock: Callable[[], float] = time.monotonic,
        name: str = "model",
        listeners: Iterable[Callable[[BatchRecord], None]] = (),
    ) -> None:
        if isinstance(runner, Runner):
            fn, spec = batch_function(runner), spec or runner.spec
        elif callable(runner) and spec is not None:
            fn = runner
        else:
            raise TypeError("SequenceBatcher needs a Runner, or a batch function and spec=")
        if not spec.batched:
            raise ValueError(f"{name}: sequence batching needs max_batch_size > 0 in the model")
        self.model_spec = spec
        self._state = SequenceState(spec, sequence, name)
        self.spec = self._state.served
        max_batch = policy.effective_max_batch_size(spec.max_batch_size)
        self.policy = replace(policy, max_batch_size=max_batch)
        self.sequence, self.name, self.instance_count = sequence, name, instance_count
        self.stats = BatcherStats()
        self.listeners = list(listeners)
        self._fn = fn
        self._is_async = asyncio.iscoroutinefunction(fn)
        self._end = getattr(runner, "end_sequence", None)
        self._clock = clock
        self._schedule = SequenceSchedule(
            sequence, instances=instance_count, max_batch_size=max_batch, clock=clock, name=name
        )
        self._pools = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"servekit-{name}-{i}")
            for i in range(instance_count)
        ]
        self._inputs = {t.name: t for t in spec.inputs}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: dict[object, tuple[Arrays, asyncio.Future[Arrays], float]] = {}
        self._closed = False

    @property
    def pending(self) -> int:
        """Requests waiting for their turn (Triton's ``nv_inference_pending_request_count``)."""
        return self._schedule.pending

    @property
    def closed(self) -> bool:
        return self._closed

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        sequence: SequenceFlags | None = None,
        priority: int = 0,
        timeout_us: int | None = None,
    ) -> Arrays:
        """One request of a sequence: its outputs once it has run, in its sequence's turn.

        Raises:
            InvalidInput: bad inputs, no sequence id, a first request without START, a
                request after END, or a CORRID the model cannot hold.
            ModelNotReady: the batcher is closed.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:  # another thread's loop: hand it over
            call = self.infer(inputs, sequence=sequence)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop))
        if self._closed:
            raise ModelNotReady(f"{self.name}: sequence batcher is closed")
        if sequence is None:
            raise InvalidInput(
                f"model {self.name!r} serves sequences: each request must carry sequence_id "
                "(and sequence_start on the first of a sequence, sequence_end on the last)"
            )
        try:
            rows = self.spec.validate_inputs(inputs)
            if rows != 1:
                raise InvalidInput(
                    f"model {self.name!r}: a request of a sequence carries one row, got {rows}"
                )
            self._check_corrid(sequence)
            key = object()
            self._schedule.submit(key, sequence)
        except InvalidInput:
            self.stats.request_invalid += 1
            raise
        self.stats.request_admitted += 1
        future: asyncio.Future[Arrays] = loop.create_future()
        self._waiting[key] = (dict(inputs), future, self._clock())
        self._poke()
        try:
            return await future
        except asyncio.CancelledError:
            self.stats.request_cancelled += 1
            ended = self._schedule.cancel(key)
            self._waiting.pop(key, None)
            if ended is not None:
                self._ended([ended])
                self._poke()
            raise

    def _check_corrid(self, flags: SequenceFlags) -> None:
        name = self.sequence.controls.corrid
        if name is None:
            return
        tensor = self._inputs[name]
        if isinstance(flags.id, str) and tensor.dtype.datatype != "BYTES":
            raise InvalidInput(
                f"sequence_id {flags.id!r} is a string; model {self.name!r} takes "
                f"{tensor.describe()} as its CORRID, a number"
            )

    # ------------------------------------------------------------------ batches
    def _poke(self) -> None:
        """Start what is due, release what idled, and wake again when more may be."""
        if self._loop is None or self._closed:
            return
        self._ended(self._schedule.expire())
        for batch in self._schedule.take():
            self._launch(batch)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        wake = self._schedule.next_wake()
        if wake is not None:
            self._timer = self._loop.call_later(max(wake - self._clock(), 0.0), self._poke)

    def _launch(self, batch: SequenceBatch) -> None:
        assert self._loop is not None
        now = self._clock()
        queue_us = tuple((now - self._waiting[k][2]) * 1e6 for k in batch.keys)
        try:
            inputs = self._state.inputs(self._rows(batch))
        except Exception as exc:  # a bug in assembling: fail this batch, not the loop
            self._complete(batch, queue_us, as_error(exc, self.name), 0.0)
            return
        if self._is_async:
            task = detached(self._loop, self._run_async(batch, inputs, queue_us))
            task.add_done_callback(lambda _: None)
            return
        done = self._loop.run_in_executor(self._pools[batch.instance], self._run, inputs)
        done.add_done_callback(lambda f: self._ran(batch, queue_us, f))

    def _ran(self, batch: SequenceBatch, queue_us: tuple[float, ...], done: Any) -> None:
        """A batch's thread is done; one that never ran (the batcher closing) fails its
        callers instead of leaving them waiting."""
        if done.cancelled() or done.exception() is not None:
            self._complete(batch, queue_us, ModelNotReady(f"{self.name}: batch not run"), 0.0)
            return
        self._complete(batch, queue_us, *done.result())

    def _run(self, inputs: Arrays) -> tuple[Arrays | ServekitError, float]:
        start = time.perf_counter()
        try:
            outputs = dict(self._fn(inputs))
            self.model_spec.check_outputs(outputs, len(next(iter(inputs.values()))))
        except Exception as exc:
            return as_error(exc, self.name), (time.perf_counter() - start) * 1e6
        return outputs, (time.perf_counter() - start) * 1e6

    async def _run_async(self, batch: SequenceBatch, inputs: Arrays, queue_us: tuple) -> None:
        start = time.perf_counter()
        try:
            outputs: Arrays = dict(await awaited(self._fn(inputs)))  # type: ignore[arg-type]
            self.model_spec.check_outputs(outputs, len(batch.rows))
            outcome: Arrays | ServekitError = outputs
        except Exception as exc:
            outcome = as_error(exc, self.name)
        except asyncio.CancelledError:  # the loop closing: its callers are failed, not left
            closing = ModelNotReady(f"{self.name}: batch not run (event loop closing)")
            self._complete(batch, queue_us, closing, 0.0)
            raise
        self._complete(batch, queue_us, outcome, (time.perf_counter() - start) * 1e6)

    def _rows(self, batch: SequenceBatch) -> list[Row]:
        return [
            (row[1], self._waiting[row[0]][0]) if row is not None else None for row in batch.rows
        ]

    def _complete(
        self,
        batch: SequenceBatch,
        queue_us: tuple[float, ...],
        outcome: Arrays | ServekitError,
        compute_us: float,
    ) -> None:
        ok = not isinstance(outcome, ServekitError)
        answers: list[Arrays | None] = []
        if not isinstance(outcome, ServekitError):
            rows: list[Row] = [(row[1], {}) if row is not None else None for row in batch.rows]
            answers = self._state.outputs(  # a sequence released while it ran keeps no state
                rows, outcome, keep=lambda flags: flags.id in self._schedule.sequences
            )
        for i, row in enumerate(batch.rows):
            if row is None:
                continue
            waiting = self._waiting.pop(row[0], None)
            if waiting is None or waiting[1].done():
                continue  # its caller left
            if isinstance(outcome, ServekitError):
                self.stats.request_failure += 1
                waiting[1].set_exception(outcome)
                continue
            answer = answers[i]
            assert answer is not None  # a row with a request
            self.stats.request_success += 1
            waiting[1].set_result(answer)
        real = len(batch.keys)
        self.stats.execution_count += 1
        self.stats.inference_count += real
        self.stats.batch_rows[len(batch.rows)] += 1
        self.stats.queue_us += sum(queue_us)
        self.stats.compute_us += compute_us
        record = BatchRecord(
            real,
            len(batch.rows),
            queue_us,
            compute_us,
            None if ok else outcome,  # type: ignore[arg-type]
        )
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("%s: a batch listener failed", self.name)
        self._ended(self._schedule.done(batch))
        self._poke()

    def _ended(self, ended: list[Ended]) -> None:
        """Sequences released: fail what they still had waiting, drop their state, and tell
        the model (on the instance that ran them, after their last batch)."""
        for e in ended:
            for key in e.keys:
                waiting = self._waiting.pop(key, None)
                if waiting is not None and not waiting[1].done():
                    self.stats.request_failure += 1
                    waiting[1].set_exception(
                        InvalidInput(
                            f"sequence {e.id!r} of model {self.name!r} was cancelled (a request "
                            "of it was abandoned by its client); start it again"
                        )
                    )
            self._state.drop(e.id)
            if self._end is not None:
                pool = self._pools[e.instance if e.instance is not None else 0]
                pool.submit(self._tell, e.id, e.reason)

    def _tell(self, sequence_id: Any, reason: str) -> None:
        try:
            self._end(sequence_id, reason)  # type: ignore[misc]
        except Exception:
            log.exception("%s: end_sequence(%r, %r) failed", self.name, sequence_id, reason)

    async def aclose(self) -> None:
        """Stop: fail what waits, let running batches finish, end the instance threads."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for _, future, _ in list(self._waiting.values()):
            if not future.done():
                future.set_exception(ModelNotReady(f"{self.name}: sequence batcher closed"))
        for pool in self._pools:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown, True)

    def close(self) -> None:
        """``aclose`` for threaded callers."""
        self._closed = True
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(30)
        else:
            for pool in self._pools:
                pool.shutdown(wait=True)
