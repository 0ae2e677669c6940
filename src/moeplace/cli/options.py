"""Option groups shared by commands, each declared once.

:func:`add_deployment_options` is the deployment group of every command that prices time (plan, compare,
simulate, operate, run-ep, demo): cluster shape and hardware, hidden size, element bytes, kernel mode, replica rule,
overlap and batch sizes. :func:`deployment_from_args` turns the parsed flags into a
:class:`moeplace.deploy.Deployment`. Defaults are the library's (``Deployment``, equal to ``CostConfig`` and
``BatchConfig``); the choices of ``--mode`` and ``--rule`` come from the simulator's registries.
"""

from __future__ import annotations

import argparse
import sys

from moeplace.cli import MAX_TOKENS, float_in, int_in

DEPLOYMENT_FLAGS = ("--cluster", "--cluster-preset", "--hidden-size", "--dispatch-bytes", "--combine-bytes", "--mode",
                    "--rule", "--overlap", "--decode-batch", "--prefill-tokens")
PROFILE_FLAGS = ("--profile", "--profile-phase", "--decode-running")  # commands that take a deployment profile


class _Explicit(argparse.Action):
    """Store the value and remember that the flag was given (a profile's field is overridden only by a flag the
    user gave, not by a default)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = set(getattr(namespace, "deployment_given", None) or ())
        namespace.deployment_given = given | {self.dest}


def add_deployment_options(parser: argparse.ArgumentParser, cluster_default: str | None = None,
                           hidden_default: int | None = None, profiles: bool = True) -> None:
    """Add the deployment group (:data:`DEPLOYMENT_FLAGS`, and :data:`PROFILE_FLAGS` when ``profiles``) to
    ``parser``; ``hidden_default``: a command's own default hidden size (run-ep's emulated layer) instead of the
    trace's."""
    from moeplace.deploy import CLUSTER_PRESETS, Deployment
    from moeplace.deploy.profiles import PROFILES
    from moeplace.simulate.config import MODES, RULES

    d = Deployment.__dataclass_fields__
    g = parser.add_argument_group("deployment", "the cluster and what a layer costs on it (docs/PRESETS.md, "
                                  "docs/DEPLOYMENT.md)")
    parser.set_defaults(deployment_given=frozenset())
    if profiles:
        g.add_argument("--profile", choices=list(PROFILES), metavar="NAME",
                       help="a deployment profile (moeplace profiles): cluster, batch sizes, kernel, rule and model "
                            "sizes of a real deployment, per phase; the flags below given explicitly override single "
                            f"fields. One of: {', '.join(PROFILES)}")
        g.add_argument("--profile-phase", choices=("prefill", "decode"),
                       help="the phase whose pool a single-plan command uses when the profile runs prefill and "
                            "decode on different clusters")
        g.add_argument("--decode-running", type=int_in(1, MAX_TOKENS), action=_Explicit,
                       help="continuous batching of decode: running requests over all GPUs (default: windows of "
                            "--decode-batch requests; a profile: B x W)")
    shown = f" (default: {cluster_default})" if cluster_default else ""
    g.add_argument("--cluster", default=cluster_default, metavar="SPEC", action=_Explicit,
                   help="NODESxGPUS (e.g. 4x2; generic H100 links), a cluster preset name (one node of it), or NODES "
                        f"with --cluster-preset{shown}")
    g.add_argument("--cluster-preset", action=_Explicit, choices=sorted(CLUSTER_PRESETS), metavar="PRESET",
                   help="links, latencies, GPU FLOP rate and HBM of a GPU system: "
                        f"{', '.join(sorted(CLUSTER_PRESETS))}")
    g.add_argument("--hidden-size", action=_Explicit, type=int_in(1, 1 << 20),
                   default=d["hidden_size"].default if hidden_default is None else hidden_default,
                   help="elements per token vector (default: "
                        + ("the trace's)" if hidden_default is None else f"{hidden_default})"))
    g.add_argument("--dispatch-bytes", action=_Explicit, type=float_in(0, 64, lo_open=True),
                   default=d["dispatch_bytes"].default,
                   help="bytes per element sent by dispatch (default: %(default)s = fp8)")
    g.add_argument("--combine-bytes", action=_Explicit, type=float_in(0, 64, lo_open=True),
                   default=d["combine_bytes"].default,
                   help="bytes per element returned by combine (default: %(default)s = bf16)")
    g.add_argument("--mode", action=_Explicit, choices=MODES, default=d["mode"].default,
                   help="dispatch/combine kernel of the time model; auto = deepep-normal for prefill, deepep-ll for "
                        "decode (default: %(default)s)")
    g.add_argument("--rule", action=_Explicit, choices=RULES, default=d["rule"].default,
                   help="replica choice rule (default: %(default)s)")
    g.add_argument("--overlap", action=_Explicit, nargs=0, const=True, default=False,
                   help="two-batch overlap of dispatch, expert compute and combine")
    g.add_argument("--decode-batch", action=_Explicit, type=int_in(1, 1 << 20),
                   default=d["decode_batch"].default,
                   help="requests per decode window (default: %(default)s)")
    g.add_argument("--prefill-tokens", action=_Explicit, type=int_in(1, MAX_TOKENS),
                   default=d["prefill_tokens"].default,
                   help="prefill micro-batch token budget (default: %(default)s)")


def profile_overrides(args: argparse.Namespace) -> dict:
    """The deployment flags the user gave explicitly, as :func:`moeplace.deploy.profiles.phase_deployments`
    overrides."""
    return {k: getattr(args, k) for k in sorted(getattr(args, "deployment_given", ()) or ())}


def phase_deployments_from_args(args: argparse.Namespace) -> dict | None:
    """phase -> Deployment of ``--profile`` with the explicit flags applied, or None without a profile."""
    from moeplace.cli import CliError
    from moeplace.deploy.profiles import get_profile, phase_deployments

    if not getattr(args, "profile", None):
        return None
    try:
        return phase_deployments(get_profile(args.profile), **profile_overrides(args))
    except ValueError as e:
        raise CliError(f"--profile {args.profile}: {e}") from None


def deployment_from_args(args: argparse.Namespace):  # -> moeplace.deploy.Deployment
    """The :class:`~moeplace.deploy.Deployment` the group's flags name (with ``--profile``: the profile's, one
    pool of it with ``--profile-phase``); ValueError (exit 2) for a bad --cluster."""
    from moeplace.cli import CliError
    from moeplace.deploy import Deployment, cluster_note, parse_cluster

    deps = phase_deployments_from_args(args)
    if deps is not None:
        from moeplace.deploy.profiles import get_profile, merged_deployment

        if getattr(args, "profile_phase", None):
            return deps[args.profile_phase]
        try:
            return merged_deployment(get_profile(args.profile), deps)
        except ValueError as e:
            raise CliError(f"--profile {args.profile}: {e}") from None
    if getattr(args, "profile_phase", None):
        raise CliError("--profile-phase needs --profile")
    if not args.cluster:
        raise CliError("--cluster is required: NODESxGPUS (e.g. 4x2), a preset name, or NODES with --cluster-preset")
    try:
        cluster = parse_cluster(args.cluster, args.cluster_preset)
    except ValueError as e:  # name the flag: the message is read without the command line beside it
        raise CliError(f"--cluster {args.cluster}: {e}") from None
    note = cluster_note(args.cluster, args.cluster_preset)
    if note:
        print(note, file=sys.stderr, flush=True)
    return Deployment(cluster, args.cluster_preset, args.hidden_size,
                      args.dispatch_bytes, args.combine_bytes, args.mode, args.rule, args.overlap, args.decode_batch,
                      args.prefill_tokens, getattr(args, "decode_running", None))


def cost_config(dep, **kw):  # -> moeplace.simulate.CostConfig
    """The simulator's time model for a deployment (``kw``: further CostConfig fields)."""
    from moeplace.simulate import CostConfig

    kw.setdefault("intermediate_size", dep.intermediate_size)
    return CostConfig(hidden_size=dep.hidden_size, dispatch_bytes=dep.dispatch_bytes,
                      combine_bytes=dep.combine_bytes, mode=dep.mode, overlap=dep.overlap, **kw)


def batch_config(dep):  # -> moeplace.simulate.BatchConfig
    """The simulator's micro-batching for a deployment."""
    from moeplace.simulate import BatchConfig

    return BatchConfig(decode_batch=dep.decode_batch, prefill_tokens=dep.prefill_tokens,
                       decode_running=dep.decode_running)


def refuse_unpriced(args: argparse.Namespace, used: tuple[str, ...], command: str) -> None:
    """CliError (one line) when a deployment flag ``command`` does not price with yet was given a non-default
    value: a flag is never silently ignored. ``used``: the group's flags the command takes."""
    from moeplace.cli import CliError

    defaults = {"hidden_size": None, "dispatch_bytes": 1.0, "combine_bytes": 2.0, "mode": "auto", "overlap": False}
    for k, v in defaults.items():
        flag = "--" + k.replace("_", "-")
        if flag not in used and getattr(args, k) != v:
            raise CliError(f"{flag} is not used by {command} (it prices with {', '.join(used)})")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine`` and ``--address``: where the work runs (:mod:`moeplace.engine`, docs/SCALE.md)."""
    g = parser.add_argument_group("engine (docs/SCALE.md)")
    g.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: this process (default); ray: Ray tasks, results byte-identical to local")
    g.add_argument("--address", metavar="HOST:PORT",
                   help="Ray cluster to join (a head node's HOST:PORT, ray://HOST:PORT or auto); without it "
                        "--engine ray starts a local cluster of 2 workers")


def engine_from_args(args: argparse.Namespace):
    """The engine the flags ask for, or None for the default single-process path (imports Ray only for ray)."""
    if args.engine == "local" and args.address is None:
        return None
    from moeplace.engine import make_engine

    return make_engine(args.engine, args.address)
