"""`launch`: the `TriForceServer` deployment on a Ray cluster, behind one HTTP route (``hf-triforce serve``).

Without ``address`` it starts a local one-machine Ray cluster (no dashboard), its workers at this process's
niceness; with ``address`` (``"auto"`` or ``"<head ip>:6379"``) it joins a running cluster, whose nodes each host
replicas and an HTTP proxy on ``port``. A start that fails raises `StartFailed`, one line naming the cause.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from .deployment import ServerSettings, TriForceServer, triforce_setting

APP_NAME = "hf-triforce"
LOCAL_OBJECT_STORE_BYTES = 256 << 20
# seconds Ray Serve gives its HTTP proxy to answer its first readiness check (Ray's 5 s kill it on a busy machine)
PROXY_READY_SECONDS = "60"
PROXY_LOCATIONS = ("EveryNode", "HeadOnly")


class StartFailed(RuntimeError):
    """The server did not start; the message is one line naming the cause."""


def _cause(error: BaseException) -> str:
    """The innermost error's last line (a replica's constructor's error arrives wrapped in Ray's tracebacks)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def deployment_options(replicas: int, autoscaling: str | None, threads: int | None,
                       max_ongoing_requests: int, max_replicas_per_node: int | None = None) -> dict:
    """Ray Serve options of the deployment: a fixed replica count, or an autoscaling config (JSON: Ray Serve's
    ``autoscaling_config``, e.g. ``{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}``); each
    replica reserves ``threads`` CPUs (1 when None), which places replicas by the cores nodes have free;
    ``max_replicas_per_node`` spreads them over the nodes."""
    options: dict = {"ray_actor_options": {"num_cpus": threads or 1}, "max_ongoing_requests": max_ongoing_requests}
    if max_replicas_per_node is not None:
        if max_replicas_per_node < 1:
            raise ValueError(f"--max-replicas-per-node must be >= 1, got {max_replicas_per_node}")
        options["max_replicas_per_node"] = max_replicas_per_node
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
           max_ongoing_requests: int = 16, max_replicas_per_node: int | None = None,
           proxy_location: str = "EveryNode") -> None:
    """Start (or join) the Ray cluster and run the deployment; returns once every replica is ready (the cluster
    keeps serving until `shutdown` or the process exits). ``proxy_location``: Ray Serve's, ``"EveryNode"`` (an HTTP
    proxy on each node, at ``port``) or ``"HeadOnly"`` (nodes sharing one host need that)."""
    from ray import serve

    triforce_setting(settings.triforce)  # a bad --triforce-config fails here, not in every replica
    if proxy_location not in PROXY_LOCATIONS:
        raise ValueError(f"--proxy-location must be one of {', '.join(PROXY_LOCATIONS)}, got {proxy_location!r}")
    options = deployment_options(replicas, autoscaling, settings.threads, max_ongoing_requests,
                                 max_replicas_per_node)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if settings.niceness is None:
        settings = replace(settings, niceness=niceness)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_SECONDS)
    try:
        _start_cluster(address, cluster_cpus, niceness)
        serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    except Exception as error:
        raise StartFailed(f"Ray Serve did not start ({_cause(error)})") from error
    try:
        serve.run(TriForceServer.options(**options).bind(settings), name=APP_NAME, route_prefix="/")
    except Exception as error:
        raise StartFailed(f"the replicas did not start ({_replica_cause() or _cause(error)})") from error


def _replica_cause() -> str | None:
    """The last line of the deployment's status message (a replica constructor's traceback ends with its error)."""
    from ray import serve

    application = serve.status().applications.get(APP_NAME)
    messages = [status.message for status in application.deployments.values()] if application else []
    lines = [line.strip() for message in messages for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


def _start_cluster(address: str | None, cluster_cpus: int | None, niceness: int) -> None:
    import ray

    if address is None:
        # the replicas import this package as the driver does (a checkout run in place included)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        # the object store carries requests and answers only (tensors stay in the replicas): a small one
        env = {"PYTHONPATH": path, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S":
               os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]}
        # address="local": a cluster of its own, even where another one on this machine would be found
        ray.init(address="local", num_cpus=cluster_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES, runtime_env={"env_vars": env},
                 _system_config={"worker_niceness": niceness})
    else:
        ray.init(address=address, log_to_driver=False)


def shutdown() -> None:
    """Stop the deployment and leave the cluster (a local cluster stops)."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
