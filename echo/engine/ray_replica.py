"""Data-parallel replicas as Ray actors (--data-parallel-backend ray).

Each replica is one actor running an EngineCoreProc: the same busy loop, IO threads and worker
processes as `echo serve` on one node, with its two sockets bound on TCP at the actor's node
address instead of ipc, so the frontend reaches it from any node of the cluster. The actor
holds one placement-group bundle with all of its replica's GPUs (tensor_parallel_size of them,
one CPU on CPU-only clusters): a bundle lives on one node, and the replica's workers are the
actor's child processes (they inherit the GPUs Ray gave it), so they stay on that node.

Faults use Ray's own actor restart (max_restarts): when the actor dies, its pending `run` call
fails, the frontend fails that replica's requests and asks the restarted actor for its new
addresses. The frontend connects to an existing cluster (ray_address or RAY_ADDRESS, as Ray
reads it) or starts a local one, which it shuts down with the last replica.
"""

import os
import socket
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from echo.config import EngineConfig
from echo.engine.core_client import EngineDeadError
from echo.engine.replicas import Replica

ACTOR_MAX_RESTARTS = 8  # per replica, over the server's life
ACTOR_CONCURRENCY = 3  # run, and the frontend's ready / wait_stopped probes beside it
PLACEMENT_TIMEOUT_S = 120.0


def _free_tcp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineCoreActor:
    """The Ray actor of one replica: builds its core (and workers) in __init__, which Ray runs
    again on a restart; `run` is the busy loop, returning once the frontend shuts it down.
    Threaded (ACTOR_CONCURRENCY): `ready` and `wait_stopped` answer while `run` runs."""

    def __init__(self, config: EngineConfig, index: int):
        from echo.engine.core_proc import EngineCoreProc

        host = ray.util.get_node_ip_address()
        self.input_address = f"tcp://{host}:{_free_tcp_port(host)}"
        self.output_address = f"tcp://{host}:{_free_tcp_port(host)}"
        self.proc = EngineCoreProc(config, self.input_address, self.output_address)
        self.stopped = threading.Event()
        self.info = {"num_gpu_blocks": self.proc.core.num_blocks,
                     "max_model_len": config.model.max_model_len, "replica": index,
                     "node": host, "pid": os.getpid(),
                     "input_address": self.input_address, "output_address": self.output_address}

    def ready(self) -> dict:
        return self.info

    def run(self) -> None:
        try:
            self.proc.step_forever()  # returns when the frontend shuts it down
        except BaseException:
            # the core failed (its error already went to the frontend) but this process lives
            # on: exit, so that Ray restarts the actor with a fresh core
            os._exit(1)
        self.stopped.set()

    def wait_stopped(self) -> None:
        self.stopped.wait()


class RayCluster:
    """The frontend's connection to Ray, shared by its replicas: joined (or started) by the
    first, shut down with the last if this process started it."""

    def __init__(self, address: str | None):
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self._users = 0
        self._lock = threading.Lock()
        self._started_here = False

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0 and not ray.is_initialized():
                # log_to_driver off: the replicas' own stderr stays in Ray's logs, not the server's
                ray.init(address=self.address, log_to_driver=False,
                         include_dashboard=False if self.address is None else None)
                self._started_here = True
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._started_here:
                ray.shutdown()
                self._started_here = False


class RayReplica(Replica):
    def __init__(self, config: EngineConfig, index: int, cluster: RayCluster):
        super().__init__(config, index)
        self.cluster = cluster
        self.actor = None
        self.group = None
        self.run_ref = None
        # what exit_error watches: run_ref, a wait_stopped call, or a ready probe (is_probe)
        self.watch = None
        self.is_probe = False
        self.info: dict = {}

    def _bundle(self) -> dict:
        if self.config.device.device == "cuda":
            return {"GPU": self.config.parallel.tensor_parallel_size, "CPU": 1}
        return {"CPU": 1}

    def launch(self) -> None:
        self.cluster.acquire()
        bundle = self._bundle()
        self.group = placement_group([bundle], strategy="STRICT_PACK",
                                     name=f"echo-replica-{self.index}-{os.getpid()}")
        actor_class = ray.remote(max_restarts=ACTOR_MAX_RESTARTS, max_task_retries=0,
                                 max_concurrency=ACTOR_CONCURRENCY)(EngineCoreActor)
        self.actor = actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            name=f"echo-replica-{self.index}-{os.getpid()}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, 0),
        ).remote(self.config, self.index)

    def wait_ready(self, timeout_s: float) -> dict:
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"replica {self.index}: the Ray cluster has no room for a "
                               f"{self._bundle()} bundle within {PLACEMENT_TIMEOUT_S:.0f} s "
                               "(its resources: "
                               f"{ray.available_resources()})") from None
        try:
            self.info = ray.get(self.actor.ready.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"replica {self.index}: not ready within {timeout_s:.0f} s") \
                from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"replica {self.index} failed to start:\n{e}") from None
        self.input_address = self.info["input_address"]
        self.output_address = self.info["output_address"]
        self.run_ref = self.watch = self.actor.run.remote()
        self.is_probe = False
        return self.info

    def exit_error(self) -> EngineDeadError | None:
        """Never blocks. A watched call that fails with ActorUnavailableError says only that
        Ray could not reach the actor for a while (a busy node): a ready probe then tells the
        same core (watch it again), a restarted one (this incarnation is gone) or a death."""
        if self.watch is None:
            return None
        done, _ = ray.wait([self.watch], timeout=0)
        if not done:
            return None
        try:
            result = ray.get(done[0])
        except ray.exceptions.ActorUnavailableError:
            self.watch, self.is_probe = self.actor.ready.remote(), True
            return None
        except ray.exceptions.RayError as e:
            return EngineDeadError(f"the Ray actor of replica {self.index} died: "
                                   f"{type(e).__name__}")
        if self.is_probe:
            if result["pid"] == self.info["pid"]:  # the same core, still running
                self.watch, self.is_probe = self.actor.wait_stopped.remote(), False
                return None
            return EngineDeadError(f"the Ray actor of replica {self.index} was restarted")
        return EngineDeadError(f"replica {self.index} stopped")

    def relaunch(self) -> None:
        # Ray restarts the actor itself (max_restarts): wait_ready asks the new one
        self.run_ref = self.watch = None

    def stop(self, timeout_s: float) -> None:
        if self.actor is None:
            return
        if self.run_ref is not None:  # the frontend sent SHUTDOWN: let the core stop its workers
            ray.wait([self.run_ref], timeout=timeout_s)
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self.group)
        self.actor = self.group = self.run_ref = self.watch = None
        self.cluster.release()


def create_ray_replicas(config: EngineConfig) -> list[Replica]:
    cluster = RayCluster(config.parallel.ray_address)
    return [RayReplica(config, i, cluster) for i in range(config.parallel.data_parallel_size)]
