"""`glassformer serve`: an OpenAI-compatible HTTP server over the serving engine."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket

from ..errors import InputError
from ..model.sizes import MIB, check_fits
from .options import (
    CONTEXT,
    ENGINE,
    add,
    add_computing,
    engine_config,
    inference_precision,
    non_negative,
    non_negative_int,
    or_default,
    positive,
    positive_int,
    settle_threads,
)
from .waits import announce, announce_engine

SERVE_EXTRA = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette", "h11")  # and theirs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (HTTP)")
    add(parser, "--model", required=True)
    parser.add_argument("--name", default=None, help="the model's name in the API (default: --model)")
    add(parser, "--quantize", "--lora", "--compile", "--deterministic")
    parser.add_argument("--lora-dir", action="append", default=None, metavar="DIR",
                        help="turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter for "
                             "adapters under DIR (repeat for more folders; without it both answer "
                             "403: only --lora's adapters are served)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=port_number, default=8000, help="TCP port (0: any free one)")
    parser.add_argument("--api-key", default=os.environ.get("GLASSFORMER_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1, /ui and /ui/state (the page "
                             "also takes ?key=KEY); /health never, /metrics only with --metrics-key "
                             "(default: $GLASSFORMER_API_KEY)")
    parser.add_argument("--metrics-key", action="store_true",
                        help="/metrics needs the API key too (by default it answers without: request "
                             "ids, counts and timings, never prompt text)")
    parser.add_argument("--allowed-hosts", nargs="+", default=(), metavar="HOST",
                        help="Host header names answered besides --host, localhost, 127.0.0.1 and ::1 "
                             "(others get 403; '*': any)")
    parser.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                        help="browser origins (scheme://host:port) that may call the server besides "
                             "the allowed hosts' pages (others get 403; '*': any)")
    add(parser.add_argument_group("the serving engine"), *ENGINE, *CONTEXT)
    add(parser, "--steer")
    parser.add_argument("--max-capture-mb", type=non_negative, default=64.0,
                        help="the most one request's trace sites and lens may hold, counted at "
                             "their full length (more: 400 before it runs; 0: no trace or lens)")
    parser.add_argument("--max-queue", type=non_negative_int, default=64,
                        help="requests waiting beyond the batch (then 429)")
    parser.add_argument("--max-request-tokens", type=positive_int, default=1024,
                        help="the largest max_tokens a request may ask for (more: 400)")
    parser.add_argument("--max-body-kb", type=positive_int, default=1024,
                        help="larger request bodies get 413")
    parser.add_argument("--body-timeout", type=positive, default=10.0,
                        help="seconds to send a request's body (then 408 and the connection closes)")
    parser.add_argument("--header-timeout", type=positive, default=10.0,
                        help="seconds to send a request's headers (then 408 and the connection closes)")
    parser.add_argument("--timeout", type=positive, default=600.0,
                        help="seconds a request may run (then 504, or an error event in a stream)")
    parser.add_argument("--grace", type=non_negative, default=30.0,
                        help="on SIGTERM, seconds running requests get to finish (then 503, or an "
                             "error event in a stream)")
    parser.add_argument("--ray", action="store_true",
                        help="run on Ray Serve (pip install glassformer[ray]): a local Ray, or the "
                             "cluster RAY_ADDRESS names")
    parser.add_argument("--replicas", type=positive_int, default=1, help="--ray: copies of the server")
    add_computing(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..language_model import load

    try:
        import uvicorn

        from ..serving.api.app import create_app
        from ..serving.api.connection import header_limited
        from ..serving.api.server import LOOPBACK, ServerConfig
    except ImportError as error:  # one line naming the fix, not a traceback
        if (error.name or "").split(".")[0] not in SERVE_EXTRA:
            raise
        raise InputError("serve", f"the module {error.name} is missing; install the serve extra: "
                         "pip install 'glassformer[serve]'") from None

    check_address(args.host, args.port)  # before the model loads, as every other flag
    check_fits(args.max_body_kb * 1024, "cpu", "--max-body-kb", f"a request body of {args.max_body_kb:,} KiB")
    check_fits(args.max_capture_mb * MIB, "cpu", "--max-capture-mb",
               f"a request's capture of {args.max_capture_mb:g} MiB")
    hosts = tuple(dict.fromkeys((args.host, *LOOPBACK, *args.allowed_hosts)))
    for folder in args.lora_dir or ():
        if not os.path.isdir(folder):
            raise InputError("--lora-dir", f"{folder!r} is not a folder")
    names = [name for name, _ in args.lora or ()]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise InputError("--lora", f"the name {twice!r} is given twice; give each adapter its own "
                         "NAME=PATH")
    config = ServerConfig(args.name or args.model, args.api_key or None, args.max_queue,
                          args.max_request_tokens,
                          args.max_body_kb * 1024, args.timeout, args.body_timeout, hosts,
                          tuple(args.allowed_origins), args.metrics_key, args.header_timeout,
                          max_capture_mb=args.max_capture_mb,
                          lora_dirs=tuple(os.path.realpath(d) for d in args.lora_dir or ()))
    vectors = _steering_vectors(args.steer or [])
    if args.ray:
        if args.lora:
            raise InputError("--lora", "not with --ray (each replica would need its own copy)")
        if or_default(args.device, "cpu") != "cpu":
            raise InputError("--device", "the --ray replicas run on the cpu")
        if vectors:
            raise InputError("--steer", "not with --ray (upload vectors: POST /v1/steering_vectors)")
        return _run_on_ray(args, config, engine_config(args))
    device, precision = inference_precision(args)
    engine = engine_config(args, device)
    language_model = load(args.model, quantize=precision.quantize, announce=announce)
    announce_engine(engine, device)
    settle_threads(args)
    precision.place(language_model.model, device)
    app = create_app(language_model, config, engine, args.thread_policy, vectors)
    for name, path in args.lora or ():
        if name == config.model_name:
            raise InputError("--lora", f"{name!r} is the base model's name; give NAME=PATH")
        app.state.server.engine.load_adapter(name, path)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again for the handler it found:
    # with this one, that ends here and the command exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    settings = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace,
                              log_level="info", http=header_limited(config.header_timeout_s))
    _draining(settings, app.state.server, args.grace).run()
    return 0


def port_number(text: str) -> int:
    """--port: 0 (any free port) to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {value}")
    return value


def check_address(host: str, port: int) -> None:
    """--host names an address of this machine and --port is free on it: found out by binding
    it for a moment, before anything is loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise InputError("--host", f"{host!r} is not an address this machine can bind ({error})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind(address)
        except OSError as error:
            field = "--port" if error.errno == errno.EADDRINUSE or port < 1024 else "--host"
            raise InputError(field, f"cannot listen on {host}:{port}: {error.strerror}") from None


def _steering_vectors(specs: list[str]) -> dict:
    """NAME=PATH each: the vectors requests may name."""
    from ..interpret.steer import SteeringVector

    paths = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InputError("--steer", f"{spec!r}: give NAME=PATH (a file from glassformer steer build)")
        if name in paths:
            raise InputError("--steer", f"the name {name!r} is given twice; give each vector its own NAME")
        paths[name] = path
    return {name: SteeringVector.load(path) for name, path in paths.items()}


def _draining(settings, server, grace: float):
    """uvicorn's server, telling the app when a shutdown begins: requests still running near
    the end of the grace are answered with 503 before uvicorn would cut them off."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                server.drain(grace)
            super().handle_exit(sig, frame)

    return Draining(settings)


def _run_on_ray(args: argparse.Namespace, config, engine) -> int:
    import ray
    from ray import serve

    from ..serving.api.ray_serve import application

    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    quantize = or_default(args.quantize, "none")
    serve.run(application(args.model, quantize, config, engine, args.replicas), blocking=True)
    return 0
