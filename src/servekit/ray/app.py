"""servekit on Ray Serve: preprocess -> model -> postprocess deployments behind a KServe v2 ingress.

Thin by design: every deployment holds a servekit Runner or stage batched by servekit's
own ``Batcher`` with the same ``BatchingPolicy`` that configures Triton, and the ingress
is the core's ``KServeApp`` (``servekit.http``) over handles, so tritonclient, servekit's
client and its load generator work against it unchanged. ``max_ongoing_requests`` is set
per deployment so requests reach the Batcher together instead of one at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..batching import Batcher, BatchingPolicy
from ..config import policy_from_dict
from ..errors import ServekitError
from ..http import KServeApp
from ..spec import ModelSpec

__all__ = ["APP_ARGS", "build_app", "policy_to_dict"]

APP_ARGS = frozenset(
    {
        "model",
        "name",
        "batching",
        "threads",
        "top_k",
        "model_replicas",
        "stage_replicas",
        "model_cpus",
        "stage_cpus",
        "max_ongoing_requests",
        "autoscaling",
        "ingress_batches",
    }
)
"""What ``build_app`` reads from its args (a config's ``args:``); anything else is a typo."""


def policy_to_dict(policy: BatchingPolicy) -> dict[str, Any]:
    """A policy as the ``[batching]`` table ``policy_from_dict`` reads (for Ray's config args)."""
    data = {
        k: v
        for k, v in dataclasses.asdict(policy).items()
        if k not in ("default_queue_policy", "priority_queue_policies")
    }
    data["preferred_batch_sizes"] = list(policy.preferred_batch_sizes)
    queue = dataclasses.asdict(policy.default_queue_policy)
    queue["timeout_action"] = policy.default_queue_policy.timeout_action.value
    data["queue"] = queue
    return data


class _Batched:
    """A Runner behind a Batcher inside one replica; errors travel back as themselves."""

    def __init__(self, runner: Any, policy: Mapping[str, Any], name: str) -> None:
        self.runner = runner
        self.batcher = Batcher(runner, policy_from_dict(policy), name=name)

    async def __call__(
        self, inputs: dict[str, Any] | ServekitError
    ) -> dict[str, Any] | ServekitError:
        if isinstance(inputs, ServekitError):  # an earlier stage's error passes through
            return inputs
        try:
            return await self.batcher.infer(inputs)
        except ServekitError as exc:
            return exc  # returned, not raised: Ray would wrap it and lose its type

    def spec(self) -> ModelSpec:
        return self.runner.spec

    def where(self) -> dict[str, Any]:
        """This replica's node and batch counts (which replica did the work, and how much)."""
        import ray

        s = self.batcher.stats
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "executions": s.execution_count,
            "inferences": s.inference_count,
        }


class _Remote:
    """What ``KServeApp`` needs (``spec``, ``async infer``) over a chain of deployment handles.

    Requests are batched here too, so one handle call carries a whole batch down the
    chain: per-request handle calls cost more CPU than the model on a small machine.
    """

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        handles: tuple[Any, ...],
        policy: BatchingPolicy,
        in_flight: int,
    ) -> None:
        self.spec, self.handles = spec, handles
        self.batcher = Batcher(
            self._chain, policy, spec=spec, instance_count=in_flight, name=f"{name}-ingress"
        )

    async def _chain(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # Each stage's response goes straight to the next replica, not back through here.
        value: Any = inputs
        for handle in self.handles:
            value = handle.remote(value)
        value = await value
        if isinstance(value, ServekitError):
            raise value
        return value  # type: ignore[no-any-return]

    async def infer(self, inputs: dict[str, Any], **scheduling: Any) -> dict[str, Any]:
        return await self.batcher.infer(inputs, **scheduling)


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """The Ray Serve application (``serve run servekit.ray.app:build_app``, or the YAML config).

    ``args``: ``model`` (zoo name or ONNX path, default ``resnet50``), ``name`` (served name),
    ``batching`` (a ``[batching]`` table), ``threads``, ``top_k``, ``model_replicas``,
    ``stage_replicas``, ``model_cpus``, ``stage_cpus``, ``max_ongoing_requests``, ``autoscaling``
    (Ray's ``autoscaling_config`` for the model deployment), ``ingress_batches`` (batches
    the ingress keeps in flight; default two per model replica, plus one).
    """
    from ray import serve

    args = dict(args or {})
    unknown = sorted(set(args) - APP_ARGS)
    if unknown:
        raise ValueError(f"build_app: unknown args {unknown}; known: {sorted(APP_ARGS)}")
    model = str(args.get("model", "resnet50"))
    name = str(
        args.get(
            "name", model if "/" not in model else model.rsplit("/", 1)[-1].removesuffix(".onnx")
        )
    )
    batching = dict(args.get("batching", {"max_batch_size": 8, "max_queue_delay_us": 2000}))
    policy = policy_from_dict(batching)
    ongoing = int(args.get("max_ongoing_requests", max(4 * policy.max_batch_size, 16)))
    stage_cpus = float(args.get("stage_cpus", 0.25))
    top_k = int(args.get("top_k", 5))
    threads = args.get("threads")

    @serve.deployment(max_ongoing_requests=ongoing)
    class Model(_Batched):
        def __init__(self) -> None:
            from .. import zoo
            from ..runners.onnx import OnnxRuntimeRunner

            path = zoo.resolve(model)
            runner = OnnxRuntimeRunner(
                path,
                intra_op_threads=int(threads) if threads else None,
                max_batch_size=policy.max_batch_size,
            )
            runner.warmup()
            super().__init__(runner, batching, name)

    @serve.deployment(max_ongoing_requests=ongoing)
    class Preprocess(_Batched):
        def __init__(self, crop: int, resize: int) -> None:
            from ..stages import Preprocess as Stage

            super().__init__(
                Stage(crop=crop, resize=resize, max_batch_size=policy.max_batch_size, workers=1),
                batching,
                "preprocess",
            )

    @serve.deployment(max_ongoing_requests=ongoing)
    class Postprocess(_Batched):
        def __init__(self, num_classes: int) -> None:
            from ..stages import Postprocess as Stage

            super().__init__(
                Stage(num_classes=num_classes, top_k=top_k, max_batch_size=policy.max_batch_size),
                batching,
                "postprocess",
            )

    @serve.deployment(max_ongoing_requests=4 * ongoing)
    class Ingress:
        """KServe v2 over HTTP: ``<name>`` (tensors) and ``<name>_image`` (encoded images)."""

        def __init__(self, pre: Any, net: Any, post: Any, specs: Mapping[str, ModelSpec]) -> None:
            self.app = KServeApp(
                {
                    name: _Remote(name, specs["model"], (net,), policy, in_flight),
                    f"{name}_image": _Remote(
                        f"{name}_image", specs["image"], (pre, net, post), policy, in_flight
                    ),
                }
            )

        async def __call__(self, request: Any) -> Any:
            from starlette.responses import Response

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

    specs = _specs(model, top_k)
    replicas = int(args.get("model_replicas", 1))
    if args.get("autoscaling"):
        replicas = int(args["autoscaling"].get("max_replicas", replicas))
    # Batches in flight from the ingress: enough to keep every model replica and stage busy.
    in_flight = int(args.get("ingress_batches", 2 * replicas + 1))
    crop = specs["model"].inputs[0].shape[1]
    model_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": float(args.get("model_cpus", 1.0))}
    }
    if args.get("autoscaling"):
        model_options["autoscaling_config"] = dict(args["autoscaling"])
    else:
        model_options["num_replicas"] = replicas
    stage_options = {
        "num_replicas": int(args.get("stage_replicas", 1)),
        "ray_actor_options": {"num_cpus": stage_cpus},
    }
    pre = Preprocess.options(**stage_options).bind(crop, round(crop * 256 / 224))  # type: ignore[attr-defined]
    net = Model.options(**model_options).bind()  # type: ignore[attr-defined]
    post = Postprocess.options(**stage_options).bind(specs["model"].outputs[0].shape[0])  # type: ignore[attr-defined]
    return Ingress.options(ray_actor_options={"num_cpus": stage_cpus}).bind(pre, net, post, specs)  # type: ignore[attr-defined]


def _specs(model: str, top_k: int) -> dict[str, ModelSpec]:
    """The served signatures, from the same core objects the replicas build (on the driver)."""
    from .. import zoo
    from ..pipeline import image_classifier, is_image_classifier
    from ..runners.onnx import OnnxRuntimeRunner

    path = zoo.resolve(model)
    try:  # a redeploy whose model does not load fails here, before the cluster is touched
        runner = OnnxRuntimeRunner(path, intra_op_threads=1)
    except Exception as exc:
        raise ValueError(f"{model}: cannot load: {type(exc).__name__}: {exc}") from None
    try:
        if not is_image_classifier(runner.spec):
            raise ValueError(
                f"{model}: the Ray app serves image classifiers (one NCHW input, one logits output)"
            )
        clf = image_classifier(runner, top_k=top_k)
        specs = {"model": runner.spec, "image": clf.spec}
        clf.steps[0].close()
        return specs
    finally:
        runner.close()
