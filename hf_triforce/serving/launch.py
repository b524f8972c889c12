"""`launch`: the `TriForceServer` deployment on a Ray cluster, behind one HTTP route (``hf-triforce serve``).

Without ``address`` it starts a local one-machine Ray cluster (no dashboard); with ``address`` (``"auto"`` or
``"<head ip>:6379"``) it joins a running cluster, whose nodes each host replicas and an HTTP proxy on ``port``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from .deployment import ServerSettings, TriForceServer, triforce_setting

APP_NAME = "hf-triforce"
LOCAL_OBJECT_STORE_BYTES = 256 << 20


def deployment_options(replicas: int, autoscaling: str | None, threads: int | None,
                       max_ongoing_requests: int) -> dict:
    """Ray Serve options of the deployment: a fixed replica count, or an autoscaling config (JSON: Ray Serve's
    ``autoscaling_config``, e.g. ``{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}``); each
    replica reserves ``threads`` CPUs (1 when None), which places replicas by the cores nodes have free."""
    options: dict = {"ray_actor_options": {"num_cpus": threads or 1}, "max_ongoing_requests": max_ongoing_requests}
    if autoscaling:
        try:
            config = json.loads(autoscaling)
        except json.JSONDecodeError as error:
            raise ValueError(f"--autoscaling: not JSON ({error}): {autoscaling!r}") from error
        if not isinstance(config, dict):
            raise ValueError(f"--autoscaling must be a JSON object (Ray Serve's autoscaling_config), got "
                             f"{autoscaling!r}")
        options["autoscaling_config"] = config
    else:
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        options["num_replicas"] = replicas
    return options


def launch(settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
           autoscaling: str | None = None, address: str | None = None, cluster_cpus: int | None = None,
           max_ongoing_requests: int = 16) -> None:
    """Start (or join) the Ray cluster and run the deployment; returns once every replica is ready (the cluster
    keeps serving until `shutdown` or the process exits)."""
    import ray
    from ray import serve

    triforce_setting(settings.triforce)  # a bad --triforce-config fails here, not in every replica
    options = deployment_options(replicas, autoscaling, settings.threads, max_ongoing_requests)
    if address is None:
        # the replicas import this package as the driver does (a checkout run in place included)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        # the object store carries requests and answers only (tensors stay in the replicas): a small one
        ray.init(num_cpus=cluster_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, runtime_env={"env_vars": {"PYTHONPATH": path}})
    else:
        ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(TriForceServer.options(**options).bind(ServerSettings(**asdict(settings))), name=APP_NAME,
              route_prefix="/")


def shutdown() -> None:
    """Stop the deployment and leave the cluster (a local cluster stops)."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
