"""Data-parallel replicas: N whole engines (an EngineCore each, with its own workers) that one
frontend talks to over their sockets.

A Replica is where one core runs and how to reach it: `launch()` starts it, `wait_ready()`
blocks until it serves (and says at which addresses), `exit_error()` tells a dead one, and
`stop()` ends it. `relaunch()` brings a dead one back. MpReplica runs the core as a process of
this node (CoreProcess, on its share of the GPUs); RayReplica (echo/engine/ray_replica.py) as a
Ray actor anywhere on a cluster. The frontends (AsyncClient, SyncCoreClient) connect a
CoreChannel to each and route requests with echo.engine.router.
"""

import os
from abc import ABC, abstractmethod

from echo.config import EngineConfig
from echo.engine.core_client import CoreProcess, EngineDeadError


class Replica(ABC):
    def __init__(self, config: EngineConfig, index: int):
        self.config = config
        self.index = index
        self.input_address: str | None = None
        self.output_address: str | None = None

    @abstractmethod
    def launch(self) -> None:
        """Start the core; returns before it is ready."""

    @abstractmethod
    def wait_ready(self, timeout_s: float) -> dict:
        """Block until the core serves; its start-up info. RuntimeError if it failed."""

    @abstractmethod
    def exit_error(self) -> EngineDeadError | None:
        """The error its requests get once it has died, else None."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """End it (after the frontend asked it to shut down); idempotent."""

    def relaunch(self) -> None:
        """Start a dead replica again (then wait_ready)."""
        self.stop(5.0)
        self.launch()


def replica_device_ids(index: int, tensor_parallel_size: int) -> tuple[str, ...]:
    """The GPUs of replica `index` on this node: the index-th run of tensor_parallel_size
    among the visible ones (CUDA_VISIBLE_DEVICES, else all), as vLLM's DP ranks take them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    else:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    share = devices[index * tensor_parallel_size:(index + 1) * tensor_parallel_size]
    if len(share) != tensor_parallel_size:
        raise ValueError(f"data_parallel_size: replica {index} needs GPUs "
                         f"{index * tensor_parallel_size}..{(index + 1) * tensor_parallel_size - 1}"
                         f" of the {len(devices)} visible")
    return tuple(share)


class MpReplica(Replica):
    """A core process of this node. With data parallelism on CUDA it sees only its share of
    the GPUs."""

    def __init__(self, config: EngineConfig, index: int, split_devices: bool):
        super().__init__(config, index)
        self.split_devices = split_devices
        self.core: CoreProcess | None = None

    @property
    def proc(self):
        return self.core.proc if self.core is not None else None

    def launch(self) -> None:
        devices = (replica_device_ids(self.index, self.config.parallel.tensor_parallel_size)
                   if self.split_devices else None)
        self.core = CoreProcess(self.config, devices, name=f"EngineCore_DP{self.index}")
        self.input_address = self.core.input_address
        self.output_address = self.core.output_address

    def wait_ready(self, timeout_s: float) -> dict:
        return self.core.wait_ready(timeout_s)

    def exit_error(self) -> EngineDeadError | None:
        return self.core.exit_error() if self.core is not None else None

    def stop(self, timeout_s: float) -> None:
        if self.core is not None:
            self.core.join(timeout_s)


def create_replicas(config: EngineConfig) -> list[Replica]:
    """The replicas of data_parallel_size, on the configured backend (not launched yet)."""
    parallel = config.parallel
    if parallel.data_parallel_backend == "ray":
        from echo.engine.ray_replica import create_ray_replicas

        return create_ray_replicas(config)
    split = parallel.data_parallel_size > 1 and config.device.device == "cuda"
    return [MpReplica(config, i, split) for i in range(parallel.data_parallel_size)]
