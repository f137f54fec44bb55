"""Run the API server: start the engine, serve until SIGINT/SIGTERM, drain, stop the engine."""

import argparse
import asyncio
import contextlib
import signal
import sys

import uvicorn

from echo import envs


class _Server(uvicorn.Server):
    """uvicorn's server, with signals handled by us: uvicorn re-raises a caught SIGTERM after
    its graceful shutdown, which would end the process with -15 instead of 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def begin_shutdown(self) -> None:
        # a second signal skips the wait for in-flight requests
        self.force_exit = self.should_exit
        self.should_exit = True


async def _stop_when_engine_dies(client, server: _Server) -> None:
    """A dead engine cannot recover: stop serving so that a supervisor (systemd, a container
    restart policy) sees the process end, instead of a server answering 503 forever."""
    reason = await client.wait_until_dead()
    print(f"echo: the engine died, stopping the server:\n{reason}", file=sys.stderr, flush=True)
    server.begin_shutdown()


async def _run(args: argparse.Namespace, engine_args: dict) -> int:
    from echo.engine.async_client import AsyncClient
    from echo.entrypoints.api_server import create_app

    client = AsyncClient(args.model, **engine_args)
    await client.start()
    try:
        names = args.served_model_name or [args.model or "default"]
        app = create_app(client, names, args.api_key or envs.api_key(), args.max_request_bytes)
        # uvicorn handles SIGINT/SIGTERM: stop accepting, let requests finish for up to
        # timeout_graceful_shutdown seconds, then cancel them (their generators abort)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout, loop="none",
                                lifespan="off")
        server = _Server(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.begin_shutdown)
        print(f"echo: serving {names[0]!r} on http://{args.host}:{args.port}", file=sys.stderr,
              flush=True)
        watcher = asyncio.create_task(_stop_when_engine_dies(client, server))
        await server.serve()
        engine_died = watcher.done() and not watcher.cancelled()
        watcher.cancel()
        return 1 if engine_died else 0
    finally:
        await client.shutdown()


def serve(args: argparse.Namespace, engine_args: dict) -> int:
    """Exit status: 0 after SIGINT/SIGTERM, 1 when the engine died."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_run(args, engine_args))
    return uvloop.run(_run(args, engine_args))
