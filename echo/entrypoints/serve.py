"""Run the API server: start the engine, serve until SIGINT/SIGTERM, drain, stop the engine."""

import argparse
import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys

import uvicorn

from echo import envs
from echo.entrypoints.cli import flags_without_effect


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


def _log_to_stderr(level: str) -> None:
    """echo's own loggers (requests with --enable-log-requests, internal errors) at the
    server's log level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("echo")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts, so that a port in use (or a host
    this machine does not have) is an error at once, not after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        # a name that does not resolve, or an address this machine does not have, is the
        # host's fault; anything else (in use, a privileged port) the port's
        field = ("host" if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL
                 else "port")
        raise ValueError(f"{field}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


async def _run(args: argparse.Namespace, model: str, engine_args: dict) -> int:
    from echo.engine.input_processor import read_chat_template

    _log_to_stderr(args.log_level)
    for note in flags_without_effect(args):
        print(note, file=sys.stderr, flush=True)
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    with _listening_socket(args.host, args.port) as sock:
        return await _serve_on(sock, args, model, engine_args, chat_template)


async def _serve_on(sock: socket.socket, args: argparse.Namespace, model: str,
                    engine_args: dict, chat_template: str | None) -> int:
    from echo.engine.async_client import AsyncClient
    from echo.engine.generation_config import load_generation_defaults
    from echo.entrypoints.api_server import ServerOptions, create_app

    client = AsyncClient(model, chat_template=chat_template, **engine_args)
    options = ServerOptions(
        generation_defaults=load_generation_defaults(
            args.generation_config, client.config.model.path,
            client.config.model.arch.eos_token_ids),
        log_requests=args.log_requests, allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {})
    options.check()
    await client.start()
    try:
        names = args.served_model_name or [model]
        app = create_app(client, names, args.api_key or envs.api_key(), args.max_request_bytes,
                         options)
        # uvicorn handles SIGINT/SIGTERM: stop accepting, let requests finish for up to
        # timeout_graceful_shutdown seconds, then cancel them (their generators abort)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout, loop="none",
                                lifespan="off", root_path=args.root_path,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
        server = _Server(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.begin_shutdown)
        scheme = "https" if args.ssl_certfile else "http"
        port = sock.getsockname()[1]  # the one given, or the free one picked for --port 0
        print(f"echo: serving {names[0]!r} on {scheme}://{args.host}:{port}", file=sys.stderr,
              flush=True)
        watcher = asyncio.create_task(_stop_when_engine_dies(client, server))
        await server.serve(sockets=[sock])
        engine_died = watcher.done() and not watcher.cancelled()
        watcher.cancel()
        return 1 if engine_died else 0
    finally:
        await client.shutdown()


def serve(args: argparse.Namespace, model: str, engine_args: dict) -> int:
    """Exit status: 0 after SIGINT/SIGTERM, 1 when the engine died."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_run(args, model, engine_args))
    return uvloop.run(_run(args, model, engine_args))
