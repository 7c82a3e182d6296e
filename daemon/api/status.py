"""hetspec's status endpoints: ``/health``, ``/props``, ``/metrics`` (generating is Ollama's
and OpenAI's API: ollama.py, openai.py), and what they report of the service.

Contract: ``health_of`` (``/health``: 200 when ready, else 503 with the status) reads the
service's state and its workers' without changing anything; ``props_of`` adds what serves
(models, placement, devices, runtimes, the queue, the live gamma); ``refresh_gauges`` sets the
metrics' gauges to the state now, before ``/metrics`` renders them."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from hetspec import __version__
from hetspec.daemon.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from hetspec.daemon.service import Service


def native_routes(service: Service) -> list[web.RouteDef]:
    async def health(request: web.Request) -> web.Response:
        document = health_of(service)
        return web.json_response(document, status=200 if document["status"] == "ready" else 503)

    async def props(request: web.Request) -> web.Response:
        return web.json_response(props_of(service))

    async def metrics(request: web.Request) -> web.Response:
        refresh_gauges(service)
        return web.Response(
            body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    return [
        web.get("/health", health),
        web.get("/props", props),
        web.get("/metrics", metrics),
    ]


def health_of(service: Service) -> dict:
    """What /health says: ready, loading or draining; each worker; the daemon itself."""
    supervisor = service.supervisor
    ready = service.ready()
    workers = {}
    if supervisor is not None:
        for name, client in supervisor.workers.items():
            workers[name] = {
                "pid": client.pid,
                "alive": client.alive,
                "restarts": supervisor.restarts[name],
                "device": client.ready.device if client.ready else None,
                "model": client.spec.model,
                "cores": list(client.spec.cores),
                "spare_cores": list(client.spec.spare_cores),
            }
    daemon = {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0))}
    status = "ready" if ready else ("draining" if service.draining else "loading")
    health = {"status": status, "version": __version__, "workers": workers, "daemon": daemon}
    if service.pipeline is not None:
        health["pipeline"] = service.pipeline.health()
    return health


def props_of(service: Service) -> dict:
    """What serves here: models, placement, devices, the queue and the live gamma."""
    health = health_of(service)
    roles = service.supervisor.roles if service.supervisor else None
    devices = {}
    if roles is not None:
        for role, name in (("target", roles.verifier), ("draft", roles.drafter)):
            devices[role] = health["workers"].get(name, {}).get("device")
        if service.pipeline is not None:  # the stages verify: no verifier worker
            devices["target"] = "pipeline"
    config = service.config
    last = {
        mode: controller.history[-1] if controller.history else None
        for mode, controller in service.controllers.items()
    }
    return {
        "version": __version__,
        "status": health["status"],
        "model": service.model_name,
        "models": {
            "target": {"folder": config.target.folder, "gguf": config.target.gguf},
            "draft": msgspec.to_builtins(config.draft),  # None: no draft model
        },
        "placement": config.placement,
        "devices": devices,
        "gpu_runtime": msgspec.to_builtins(service.runtime_decision)
        if service.runtime_decision
        else None,
        "drafter": msgspec.to_builtins(service.drafter) if service.drafter else None,
        "pipeline": health.get("pipeline"),
        "mode": config.mode,
        "gamma": {
            mode: {"gamma": d.gamma, "branches": d.branches, "overlap": d.overlap} if d else None
            for mode, d in last.items()
        },
        "parallel_gamma": config.gamma,
        "queue": {
            "running": service.admission.running,
            "parallel": service.admission.parallel,  # requests that decode at once
            "waiting": service.admission.waiting,
            "capacity": service.admission.capacity,
            "refused": service.admission.refused,
        },
        "chat_template": service.chat_template is not None,
        "uptime_s": round(time.monotonic() - service.started, 1),
        "workers": health["workers"],
        # the verifier on the drafter's cores too, per token alone and per node verified
        "spare_cores": {
            "alone": service.spare_cores.snapshot(),
            "verify": service.verify_cores.snapshot(),
        },
    }


def refresh_gauges(service: Service) -> None:
    """The gauges /metrics reads as they are now: the queue, each worker's restarts and life."""
    service.metrics.queue_waiting.set(service.admission.waiting)
    service.metrics.queue_running.set(service.admission.running)
    service.metrics.queue_refused.set(service.admission.refused)
    if service.supervisor is not None:
        for name, count in service.supervisor.restarts.items():
            service.metrics.worker_restarts.labels(name).set(count)
            client = service.supervisor.workers.get(name)
            service.metrics.worker_up.labels(name).set(int(bool(client and client.alive)))
