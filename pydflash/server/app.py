"""The server process: argv -> config, the step loop and the HTTP server until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from .. import errors
from .command_line import ServerConfig, build_parser, config_from_args

__all__ = ["main", "serve"]


async def serve(config: ServerConfig) -> int:
    """Load the model on the step loop's thread, listen, serve until a signal; the exit status."""
    from aiohttp import web

    from .http import HTTPServer
    from .loop import StepLoop
    from .metrics import Metrics

    loop = asyncio.get_running_loop()
    metrics = Metrics()
    steps = StepLoop(config, metrics, loop)
    server = HTTPServer(config, metrics, steps)
    # handler_cancellation: a client that drops the connection cancels its handler (and so its jobs)
    runner = web.AppRunner(server.app, handler_cancellation=True, **({} if config.verbose else {"access_log": None}))
    await runner.setup()
    sites = [web.TCPSite(runner, host, config.port) for host in config.hosts]
    try:
        for site in sites:
            await site.start()
    except OSError as exc:
        print(f"pydflash serve: cannot listen on {','.join(config.hosts)}:{config.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    port = config.port
    for sock in getattr(getattr(sites[0], "_server", None), "sockets", None) or []:
        port = sock.getsockname()[1]
        break
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / Windows
            pass
    print(f"pydflash serve: loading {config.model}" + (f" with drafter {config.drafter}" if config.drafter else "")
          + f" ({config.n_slots} slot(s))", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = 0
    steps.start()
    try:
        await asyncio.wrap_future(steps.loaded)
    except BaseException as exc:  # noqa: BLE001
        server.load_error = f"{type(exc).__name__}: {exc}"
        print(f"pydflash serve: {server.load_error}", file=sys.stderr, flush=True)
        rc = 1
        stop.set()
    if rc == 0:
        e = steps.engine
        spec = "none"
        if e.drafter is not None:
            spec = "draft-dflash n_max " + ("auto" if e.auto_n_max else str(e.n_max))
            spec += f", p_min {e.p_min}" if e.p_min else ""
        elif e.scheduler is not None and e.scheduler.lookup:
            spec = f"history drafts only (--draft-lookup {e.scheduler.lookup})"
        print(f"pydflash serve: model loaded in {time.monotonic() - t0:.1f} s; n_ctx {steps.n_ctx_slot} per slot, "
              f"speculative {spec}", file=sys.stderr)
        where = ", ".join(f"http://{f'[{h}]' if ':' in h else h}:{port}" for h in config.hosts)
        print(f"pydflash serve: listening on {where}", file=sys.stderr, flush=True)
        server.ready = True
    try:
        await stop.wait()
    finally:
        steps.stop()  # unfinished requests are answered 503, then the engine is freed
        await loop.run_in_executor(None, steps.join)
        await runner.cleanup()
    return rc


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (``pydflash serve`` and ``pydflash-server``)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"pydflash serve: ignoring unsupported llama-server arguments: {' '.join(unknown)}", file=sys.stderr)
    try:
        __import__("aiohttp")
    except ImportError:
        print("pydflash serve: needs aiohttp: pip install 'pydflash[server]'", file=sys.stderr)
        return 1
    try:
        config = config_from_args(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except errors.PydflashError as exc:  # e.g. a Hub reference that cannot be resolved: one line
        print(f"pydflash serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0
