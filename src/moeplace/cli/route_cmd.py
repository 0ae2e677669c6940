"""``moeplace route serve``: the deployable request -> rank function of a grouped plan as a small HTTP service
(docs/ROUTE.md)."""

from __future__ import annotations

import argparse
import signal
import sys

from moeplace.cli import input_file, int_in

# moeplace.plan.route's defaults, repeated so that building the parser loads no numpy (tests/test_route.py checks)
DEFAULT_HOST, DEFAULT_PORT, MAX_BODY_BYTES = "127.0.0.1", 8090, 16 << 20


def cmd_serve(args: argparse.Namespace) -> int:
    from moeplace.operate.metrics import is_loopback
    from moeplace.plan.route import Router, RouteServer

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # before the "listening" line: a supervisor (or a test) that stops the service once it reads that line must
    # find the handler in place (CI caught the race: exit -15 instead of a clean stop)
    signal.signal(signal.SIGTERM, stop)
    server, admitted = None, 0
    try:
        router = Router.load(args.grouper)
        server = RouteServer(router, args.port, args.host, args.max_body_bytes)
        if not is_loopback(args.host):
            print(f"moeplace route: note: --host {args.host} is not loopback: every machine that reaches it can ask "
                  "for routes (a request's expert counts go to this service; docs/PRIVACY.md)", file=sys.stderr)
        g = router.grouper
        print(f"routing by {args.grouper} ({router.strategy or 'plan'}: {g.num_nodes} nodes x {g.gpus_per_node} "
              f"GPUs, rounds of {g.round_size}) on {server.url}: POST /route, POST /route_batch, GET /health",
              flush=True)
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.close()
            admitted = router.admitted
    print(f"stopped after {admitted} online routes", flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="serve a grouped plan's request -> decode rank function over HTTP",
                       description="Route requests by their prefill expert counts with a plan's grouper "
                                   "(docs/ROUTE.md).",
                       epilog="example:\n  moeplace route serve --grouper grouper.json --port 8081",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    rs = p.add_subparsers(dest="route_command", metavar="SUBCOMMAND", required=True)
    s = rs.add_parser(
        "serve", help="HTTP service: POST /route, POST /route_batch, GET /health",
        description="Serve a grouper export: POST /route {\"prefill_expert_counts\": [[...]]} or {\"topk_ids\": "
                    "[[[...]]]} answers {\"rank\", \"node\", \"instance\"} with online round admission; POST "
                    "/route_batch {\"requests\": [...]} routes a batch as the evaluation does; GET /health. "
                    "Bad input is HTTP 400 with a one-line message.",
        epilog="example:\n  moeplace export plan.json --format grouper --out grouper.json\n"
               "  moeplace route serve --grouper grouper.json --port 8090",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--grouper", required=True, type=input_file,
                   help="grouper JSON from 'moeplace export PLAN --format grouper'")
    s.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    s.add_argument("--port", type=int_in(0, 65535), default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0: any free port, printed at start)")
    s.add_argument("--max-body-bytes", type=int_in(1024, 1 << 30), default=MAX_BODY_BYTES,
                   help=f"largest POST body accepted; larger is HTTP 413 (default {MAX_BODY_BYTES})")
    s.set_defaults(func=cmd_serve)
