"""servekit on Ray Serve: preprocess -> model -> postprocess deployments behind a KServe v2 ingress.

Thin by design: every deployment holds a servekit Runner or stage batched by servekit's
own ``Batcher`` with the same ``BatchingPolicy`` that configures Triton, and the ingress
is the core's ``KServeApp`` (``servekit.http``) over handles, so tritonclient, servekit's
client and its load generator work against it unchanged. ``max_ongoing_requests`` is set
per deployment so requests reach the Batcher together instead of one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

from .. import tracing
from ..batching import Batcher, BatchingPolicy
from ..batching.execute import as_error
from ..cache import ResponseCache
from ..config import ModelConfig, ServeConfig, image_model_name, version_model_name
from ..errors import ModelBroken, ServekitError, SetupFailed
from ..http import KServeApp
from ..protocol.routed import route, traffic_of
from ..recovery import Lost, Recovery, tensors_key
from ..runners.base import warm_up
from ..runners.broken import Unready
from ..runners.versioned import check_compatible
from ..runtime.base import probe_model
from ..spec import ModelSpec
from .autoscale import replicas_needed
from .replica import Batched

__all__ = ["APP_NAME", "build_app", "ray_config"]

APP_NAME = "servekit"
BROKEN_TTL_S = 1.0
"""How long the ingress trusts what a model's replica last said of its readiness."""


Key = tuple[str, int]
"""A served model's key among the ingress's chains: its name and version."""


def _by_name(models: Mapping[Key, Any]) -> dict[str, dict[int, Any]]:
    """``(name, version)``-keyed models as name -> version -> model, for ``route``."""
    out: dict[str, dict[int, Any]] = {}
    for (name, version), model in models.items():
        out.setdefault(name, {})[version] = model
    return out


def _fused(config: ServeConfig, ingress: Any) -> Any:
    """The app as one deployment: the ingress replicas serve the models themselves (an
    image classifier's ``<name>_image`` too, its stages in the replica as on native)."""
    busiest = 16
    for model in config.models:
        probe = probe_model(model, config.cache_dir, config.storage)
        max_batch = model.batching.effective_max_batch_size(probe.spec.max_batch_size) or 1
        busiest = max(busiest, 4 * max_batch)
    return ingress.options(
        num_replicas=max(m.instances for m in config.models),
        max_ongoing_requests=config.ray.max_ongoing_requests or busiest,
        ray_actor_options={"num_cpus": config.ray.model_cpus, "num_gpus": config.ray.model_gpus},
    ).bind({}, config.models)


class _Remote:
    """A ``FrontModel`` (``servekit.protocol.models``) over a chain of deployment handles.

    Requests are batched here too, so one handle call carries a whole batch down the
    chain: per-request handle calls cost more CPU than the model on a small machine.
    ``in_flight`` batches may be out at once; ``ahead``: the model's replicas, each
    given its next batch just before it frees (``Batcher(ahead=)``), 0 for as soon as
    a slot is.
    """

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        handles: tuple[Any, ...],
        policy: BatchingPolicy,
        in_flight: int,
        ahead: int = 0,
        recovery: Recovery | None = None,
    ) -> None:
        self.name, self.spec, self.handles, self.recovery = name, spec, handles, recovery
        self.versioned = False
        self.versions: tuple[str, ...] = ("1",)
        self.batcher: Batcher | None = Batcher(
            self._chain, policy, spec=spec, instance_count=in_flight, name=f"{name}-ingress",
            ahead=ahead,
        )  # fmt: skip
        self._broken: str | None = None
        self._asked = -BROKEN_TTL_S

    @property
    def broken(self) -> str | None:
        """Why the model's replicas cannot serve (``runners.broken``), as last heard from
        one (asked again in the background once ``BROKEN_TTL_S`` passed) or from a batch."""
        now = time.monotonic()
        if now - self._asked >= BROKEN_TTL_S:
            self._asked = now
            with contextlib.suppress(RuntimeError):  # no loop running: nothing to ask with
                asyncio.get_running_loop().create_task(self._ask())
        return self._broken

    async def _ask(self) -> None:
        with contextlib.suppress(Exception):  # no replica up: nothing heard (Recovery's)
            self._broken = await self.handles[-1].broken.remote()

    async def _attempt(
        self, inputs: dict[str, Any], trace: tuple[str, ...] = ()
    ) -> dict[str, Any] | BaseException:
        # Each stage's response goes straight to the next replica, not back through here.
        from ray.exceptions import RayActorError

        value: Any = inputs
        try:
            for handle in self.handles:
                value = handle.remote(value, trace) if trace else handle.remote(value)
            value = await value
        except RayActorError as exc:  # a replica died (or none is reachable): Recovery's call
            return exc
        return value  # type: ignore[no-any-return]

    async def _chain(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """One batch down the chain; re-sent while a replica's death allows (``recovery``).
        A batch in flight at two deaths is quarantined as a whole, which the Batcher then
        runs request by request, so only the poison input is refused."""
        recovery = self.recovery
        batch = tracing.BATCH.get()  # its traced requests' spans go on into the replicas
        trace = tuple(batch.parents) if batch is not None else ()
        if recovery is None:
            value: Any = await self._attempt(inputs, trace)
        else:
            key = tensors_key(self.name, "", inputs)
            recovery.refuse_poison(self.name, key)
            live = recovery.live(self.name)
            value = await recovery.replay(
                self.name, functools.partial(self._attempt, inputs, trace), _ray_lost,
                deadline=recovery.deadline(None, time.monotonic()), key=key,
                first=await self._attempt(inputs, trace), first_sent_live=live,
            )  # fmt: skip
        if isinstance(value, ModelBroken):
            self._broken = str(value)
        if isinstance(value, BaseException):
            raise value if isinstance(value, ServekitError) else as_error(value, self.name)
        return value  # type: ignore[no-any-return]

    async def infer(
        self,
        inputs: dict[str, Any],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, Any]:
        assert self.batcher is not None
        return await self.batcher.infer(inputs, priority=priority, timeout_us=timeout_us)


def _ray_lost(outcome: object) -> Lost | None:
    """A replica that died with the batch (``RayActorError``), or none reachable yet."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    if isinstance(outcome, ActorUnavailableError):
        return Lost.UNREACHABLE
    return Lost.IN_FLIGHT if isinstance(outcome, RayActorError) else None


def _cached(models: dict[Key, Any], config: ServeConfig) -> ResponseCache | None:
    """Put each model with ``response_cache`` behind this ingress replica's cache (its own
    LRU, or the Redis every replica shares); returns the cache."""
    from ..runtime.registry import behind_cache, response_cache

    cache = response_cache(config)
    if cache is None:
        return None
    for model in config.models:
        if model.response_cache:
            models[model.name, 1] = behind_cache(models[model.name, 1], model, config, cache)
    return cache


def _refusal(exc: ServekitError, message: str = "") -> Any:
    """``exc`` as the ingress answers it outside the app: its status, ``{"error": ...}``."""
    import json

    from starlette.responses import Response

    from ..errors import http_status

    body = json.dumps({"error": message or str(exc)}).encode()
    return Response(body, http_status(exc), media_type="application/json")


def _stopping() -> Any:
    """The answer to a request that reaches a replica after its drain has settled."""
    from ..errors import ModelNotReady

    return _refusal(ModelNotReady("servekit is stopping: this server takes no new requests"))


def ray_config(args: Mapping[str, Any] | ServeConfig | None = None) -> ServeConfig:
    """The ``ServeConfig`` a Ray app's ``args`` (a config file's tables) describe, checked
    for the ``ray`` runtime."""
    if isinstance(args, ServeConfig):
        config = args
    else:
        config = ServeConfig.from_dict({k: v for k, v in (args or {}).items() if k != "runtime"})
    return config.replace(runtime="ray").check()


def build_app(
    args: Mapping[str, Any] | ServeConfig | None = None, *, run_id: str | None = None
) -> Any:
    """The Ray Serve application (``serve run servekit.ray.app:build_app``, or the YAML config).

    ``args`` are a ``ServeConfig``'s tables (``models``, or one model's keys at the top
    level; ``server`` for the token and body limit; ``ray`` for the deployments). Each
    model is a deployment of ``instances`` replicas running its runner behind a Batcher
    with its own policy; an image classifier also gets preprocess and postprocess
    deployments for ``<name>_image``. Every model loads on the driver first, so a file that
    does not load fails here, before the cluster is touched. ``run_id`` (``RayRuntime``'s,
    one per run of servekit) names the run's keys in Ray's KV store: the flag its SIGTERM
    drains the ingress replicas by (``servekit.ray.drain``) and the traffic every ingress
    replica shares (``servekit.ray.shared``); without one, as under ``serve run``, they
    never drain and each ingress replica keeps its own traffic.
    """
    from ray import serve

    config = ray_config(args)
    ray = config.ray

    @serve.deployment
    class Model(Batched):
        def __init__(self, model: ModelConfig, cache_dir: str | None) -> None:
            from ..runtime.base import load_model_runner

            try:
                runner = load_model_runner(model, cache_dir, config.storage)
            except SetupFailed as exc:  # up, not ready, instead of Ray restarting it forever
                if not isinstance(exc.spec, ModelSpec):
                    raise
                runner = Unready(exc.spec, str(exc))
            warm_up(runner, model.name)
            tracer = config.server.tracing.tracing()  # this replica's spans
            super().__init__(runner, model.batching, model.name, model.autoscale, tracer)

    @serve.deployment
    class Stage(Batched):
        def __init__(self, model: ModelConfig, spec: ModelSpec, meta: dict, which: int) -> None:
            from ..pipeline import image_stages

            stage = image_stages(spec, meta, top_k=model.top_k, labels=model.labels)[which]
            name, tracer = f"{model.name}-{('pre', 'post')[which]}", config.server.tracing.tracing()
            super().__init__(stage, model.batching, name, tracing=tracer)

    @serve.deployment
    class Ingress:
        """KServe v2 over HTTP for every model (and every ``<name>_image``): over chains
        of handles, or, fused, over Batchers of the models' runners in this replica."""

        def __init__(
            self,
            chains: Mapping[Key, tuple[ModelSpec, tuple[Any, ...], Any]],
            fused: tuple[ModelConfig, ...] = (),
        ) -> None:
            from ray import serve as ray_serve

            from .drain import Gate

            replica = ray_serve.get_replica_context().replica_id.unique_id
            self.gate = Gate(run_id, replica)
            self.tracing = config.server.tracing.tracing()  # this replica's spans
            self.store: Any = None
            if config.store.active:
                from ..store import store_app

                self.app, self.store = store_app(
                    config, ready=lambda: not self.gate.draining, tracing=self.tracing
                )
                self._started: Any = None
                return
            recovery = config.server.recovery()  # this ingress replica's
            models: dict[Key, Any] = {
                (name, version): _Remote(
                    name if version == 1 else version_model_name(name, version),
                    spec, handles, policy, in_flight, ahead, recovery,
                )
                for (name, version), (spec, handles, (policy, in_flight, ahead)) in chains.items()
            }  # fmt: skip
            for model in fused:  # every version, each checked against version 1's signature
                from ..runtime.base import load_or_unready
                from ..runtime.registry import scheduled

                for m in load_or_unready(model, config.cache_dir, config.storage):
                    warm_up(m.runner, m.name)
                    if config.ray.fuse:  # the replicas are the model's instances
                        m = dataclasses.replace(m, instance_count=1)
                    models[m.name, m.version] = scheduled(m)
            self.cache = _cached(models, config)
            # A Traffic per ingress replica decides each request's version here; a change
            # made in any replica reaches every other through Ray's KV store (a run's), as
            # does a change of the trace settings.
            traffic = traffic_of(config.models)
            if run_id is not None and (traffic or self.tracing is not None):
                from .shared import SharedTraffic

                SharedTraffic(run_id, traffic, replica, tracing=self.tracing)
            self.app = KServeApp(
                route(_by_name(models), traffic),
                max_body_bytes=config.server.max_body_bytes,
                inference_token=config.server.inference_token,
                control_token=config.server.control_token,
                ready=lambda: not self.gate.draining,
                tracing=self.tracing,
            )
            self.app.metrics.autoscale.update(config.autoscale_policies())
            self.app.metrics.collect(recovery.figures)
            if self.cache is not None:
                self.app.metrics.collect(self.cache.figures)
            if config.ray.direct:
                from .direct import listen

                self.server = listen(self.app, config, self.gate)

        async def __call__(self, request: Any) -> Any:
            if not self.gate.enter():
                return _stopping()
            try:
                return await self._answer(request)
            finally:
                self.gate.leave()

        async def _answer(self, request: Any) -> Any:
            from starlette.responses import Response

            if self.store is not None:  # pins (every model, eager) load on the replica's loop
                import asyncio

                self._started = self._started or asyncio.ensure_future(self.store.start())
                try:
                    await asyncio.shield(self._started)
                except ServekitError as exc:  # every request says why, as the app would
                    return _refusal(exc, f"the store did not start: {exc}")
            if "text/event-stream" in request.headers.get("accept", ""):
                return await self._streamed(request)
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            await self.app(request.scope, request.receive, send)
            start = sent[0]
            return Response(
                content=b"".join(m.get("body", b"") for m in sent[1:]),
                status_code=start["status"],
                headers={
                    k.decode(): v.decode() for k, v in start["headers"] if k != b"content-length"
                },
            )

        async def _streamed(self, request: Any) -> Any:
            """The app's answer passed on as it is sent (a decoupled model's events): the
            client's leaving, which Ray turns into this generator's end, stops the model."""
            import asyncio

            from starlette.responses import StreamingResponse

            sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=16)
            app = asyncio.ensure_future(self.app(request.scope, request.receive, sent.put))
            first = asyncio.ensure_future(sent.get())
            await asyncio.wait({first, app}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():  # the app ended without an answer: its error, as raised
                first.cancel()
                app.result()
            start = first.result()

            async def body() -> Any:
                try:
                    while True:
                        message = await sent.get()
                        if message.get("body"):
                            yield message["body"]
                        if not message.get("more_body"):
                            return
                finally:
                    app.cancel()

            headers = {k.decode(): v.decode() for k, v in start["headers"]}
            return StreamingResponse(body(), status_code=start["status"], headers=headers)

    if config.store.active:  # the store lives in the one ingress replica, as fused models do
        return Ingress.options(  # type: ignore[attr-defined]
            num_replicas=1,
            max_ongoing_requests=ray.max_ongoing_requests or 64,
            ray_actor_options={"num_cpus": ray.model_cpus, "num_gpus": ray.model_gpus},
        ).bind({})
    if ray.fuse:
        return _fused(config, Ingress)

    chains: dict[Key, tuple[ModelSpec, tuple[Any, ...], Any]] = {}
    local: list[ModelConfig] = []
    busiest = 16
    for model in config.models:
        probe = probe_model(model, config.cache_dir, config.storage)
        if model.sequence_batching is not None or probe.decoupled:
            # A sequence's state, and a stream of responses, stay in the ingress replica
            # that holds them: every request of a sequence reaches that one replica.
            local.append(model)
            continue
        spec, image_spec, meta = probe.spec, probe.image_spec, probe.metadata
        for version in model.version_numbers[1:]:
            other = probe_model(model.for_version(version), config.cache_dir, config.storage).spec
            check_compatible(spec, other, f"{model.name} version {version}")
        max_batch = model.batching.effective_max_batch_size(spec.max_batch_size) or 1
        ongoing = ray.max_ongoing_requests or max(4 * max_batch, 16)
        busiest = max(busiest, ongoing)
        replicas = model.instances
        options: dict[str, Any] = {
            "name": model.name,
            "max_ongoing_requests": ongoing,
            "ray_actor_options": {"num_cpus": ray.model_cpus, "num_gpus": ray.model_gpus},
        }
        if ray.autoscaling and ray.autoscale_signal == "servekit":
            policy = {"policy_function": replicas_needed}
            options["autoscaling_config"] = {"policy": policy, **ray.autoscaling}
            replicas = int(ray.autoscaling.get("max_replicas", replicas))
        elif ray.autoscaling:
            # Ray counts batches in flight per model replica (the ingress batches): a replica
            # at the autoscaling signal's target fill has one running and one forming.
            target = 2 * model.autoscale.target_batch_fill
            options["autoscaling_config"] = {"target_ongoing_requests": target, **ray.autoscaling}
            replicas = int(ray.autoscaling.get("max_replicas", replicas))
        else:
            options["num_replicas"] = replicas
        # Batches in flight from the ingress: with overlap (the default here: it costs Ray
        # nothing), enough to keep every model replica and stage busy, each replica's next
        # batch leaving just before it frees (``batching.ahead``); without, one per replica.
        overlap = model.overlap is not False
        in_flight = (ray.ingress_batches or 2 * replicas + 1) if overlap else replicas
        ahead = replicas if overlap else 0
        net = Model.options(**options).bind(model, config.cache_dir)  # type: ignore[attr-defined]
        chains[model.name, 1] = (spec, (net,), (model.batching, in_flight, ahead))
        for version in model.version_numbers[1:]:
            named = {**options, "name": version_model_name(model.name, version)}
            other = Model.options(**named).bind(model.for_version(version), config.cache_dir)  # type: ignore[attr-defined]
            chains[model.name, version] = (spec, (other,), (model.batching, in_flight, ahead))
        if image_spec is None:
            continue
        stage_options = {
            "max_ongoing_requests": ongoing,
            "num_replicas": ray.stage_replicas,
            "ray_actor_options": {"num_cpus": ray.stage_cpus},
        }
        pre, post = (
            Stage.options(name=f"{model.name}_{kind}", **stage_options).bind(  # type: ignore[attr-defined]
                model, spec, meta, which
            )
            for which, kind in enumerate(("preprocess", "postprocess"))
        )
        chains[image_model_name(model.name), 1] = (
            image_spec,
            (pre, net, post),
            (model.batching, in_flight, ahead),
        )
    options = {"num_cpus": ray.stage_cpus}
    if local:  # models run in the ingress replica itself: it asks for a model's resources
        options = {"num_cpus": max(ray.stage_cpus, ray.model_cpus), "num_gpus": ray.model_gpus}
    return Ingress.options(  # type: ignore[attr-defined]
        num_replicas=ray.ingress_replicas,
        max_replicas_per_node=1 if ray.ingress_replicas > 1 else None,
        max_ongoing_requests=4 * busiest,
        ray_actor_options=options,
    ).bind(chains, tuple(local))
