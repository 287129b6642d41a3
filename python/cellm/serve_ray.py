"""cellm's OpenAI-compatible server as a Ray Serve deployment (the `ray` extra:
`pip install "cellm[ray]"`), for serving past one machine.

`python -m cellm.serve --model M --ray --replicas N [--replicas-per-node 1] [--ray-address A]`
starts (or joins, with `--ray-address`) a Ray cluster and runs N replicas of the same app
`python -m cellm.serve` runs, behind Ray Serve's HTTP proxy on `--host`/`--port`: the same
routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`), the same
OpenAI error objects. Each replica loads the model and runs its own continuous batch
(`cellm.scheduler`); Ray Serve spreads requests over the replicas.

One replica per machine is the default (`--replicas-per-node 1`, Ray's
`max_replicas_per_node`): a replica's engine already uses every thread it is given, so two on
one machine only split its cores and memory bandwidth. On a machine of several NUMA nodes, start
one Ray node per NUMA node, each pinned to its node's cores and memory (`numactl
--cpunodebind=K --membind=K ray start ...`), and give each replica that node's cores as
`--threads`: Ray schedules `--threads` CPUs per replica. The model path must name the same file
on every machine (a registry name fetches it there on first use).

`application(config, ...)` builds the Ray Serve application for `serve.run`, e.g. in tests.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional


def _import_serve() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise ImportError('cellm serve --ray needs Ray Serve: pip install "cellm[ray]"') from None
    return serve


def replica_builder(config: Mapping[str, Any]) -> Callable[[], Any]:
    """A function that builds one replica's app: loads the model named by `config` (LLM's
    keywords under "llm", the model path under "model", an optional encoder for
    /v1/embeddings under "embedding_model"), starts its scheduler and returns the
    ASGI app of `cellm.serve`. Ray Serve calls it once in each replica process."""
    config = dict(config)

    def build() -> Any:
        from cellm.embeddings import Embedder
        from cellm.llm import LLM
        from cellm.scheduler import Scheduler
        from cellm.serve import build_app

        llm = LLM(config["model"], **config.get("llm", {}))
        scheduler = Scheduler(llm, max_running=int(config.get("max_sessions", 16)))
        scheduler.start()
        name = config.get("model_name") or llm.path.stem
        encoder = config.get("embedding_model")
        threads = config.get("llm", {}).get("threads")
        embedder = Embedder(encoder, threads=threads) if encoder else None
        return build_app(
            llm, name, scheduler, config.get("image_root"), embedder, str(encoder or "")
        )

    return build


def application(
    config: Mapping[str, Any],
    replicas: int = 1,
    replicas_per_node: Optional[int] = 1,
    cpus_per_replica: float = 1.0,
    max_ongoing_requests: int = 64,
) -> Any:
    """The Ray Serve application (`serve.run(application(...), route_prefix="/")`) of
    `replicas` copies of cellm's server over the model `config` names (see
    `replica_builder`), at most `replicas_per_node` on one Ray node (None: no limit)."""
    serve = _import_serve()
    options: dict[str, Any] = {
        "name": "cellm",
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": cpus_per_replica},
        # A replica takes many requests at once: they join its continuous batch.
        "max_ongoing_requests": max_ongoing_requests,
    }
    if replicas_per_node is not None:
        options["max_replicas_per_node"] = replicas_per_node
    deployment = serve.deployment(**options)(serve.ingress(replica_builder(config))())
    return deployment.bind()


def run(
    config: Mapping[str, Any],
    replicas: int,
    replicas_per_node: Optional[int],
    cpus_per_replica: float,
    host: str,
    port: int,
    address: Optional[str] = None,
) -> None:
    """Starts Ray (or joins the cluster at `address`), serves `application(...)` on
    http://host:port until interrupted, then shuts Serve down."""
    import time

    import ray

    serve = _import_serve()
    ray.init(address=address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(
        application(config, replicas, replicas_per_node, cpus_per_replica),
        name="cellm",
        route_prefix="/",
    )
    print(f"cellm serve: {replicas} Ray Serve replica(s) on http://{host}:{port}", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
