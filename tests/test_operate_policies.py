"""The policy registry: each policy declares its parameters (name, type, range, default, help); make_policy and
``moeplace operate`` refuse a parameter the chosen policy does not declare (ValueError / exit 2, one line naming
it and the policy), and the CLI's flags and --list-policies come from the declarations."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from moeplace.operate.policies import POLICIES, make_policy, policy_params
from moeplace.params import Param, bind

REPO = Path(__file__).resolve().parents[1]
GPT_OSS_SAMPLE = REPO / "src" / "moeplace" / "data" / "gpt-oss-20b-sample.trace"
RUN = ("--cluster", "2", "--cluster-preset", "h200-8", "--redundant", "16", "--window-requests", "16",
       "--decode-batch", "8")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace", "operate", *args], capture_output=True, text=True,
                          timeout=300)


def test_every_policy_builds_with_its_declared_defaults():
    for name, spec in POLICIES.items():
        pol = make_policy(name)
        assert pol.name == name
        for p in spec.params:
            assert getattr(pol, p.name) == p.default
        settable = {f.name for f in fields(pol)} - {"name", "last"} - dict(spec.fixed).keys()
        assert {p.name for p in spec.params} == settable, f"{name}: a field is neither declared nor fixed"


@pytest.mark.parametrize(("policy", "param", "value"), [("static", "period_steps", 5),
                                                        ("moeplace", "threshold", 0.3),
                                                        ("periodic", "horizon_steps", 5),
                                                        ("static-eplb", "margin", 1.0)])
def test_make_policy_refuses_a_parameter_the_policy_does_not_declare(policy, param, value):
    with pytest.raises(ValueError, match=rf"policy '{policy}' has no parameter '{param}'"):
        make_policy(policy, **{param: value})


@pytest.mark.parametrize(("policy", "params"), [("threshold", {"threshold": 0.0}), ("threshold", {"threshold": 1.5}),
                                                ("periodic", {"period_steps": 0}),
                                                ("moeplace", {"horizon_steps": 2.5}),
                                                ("moeplace", {"margin": float("nan")})])
def test_make_policy_checks_types_and_ranges(policy, params):
    (k,) = params
    with pytest.raises(ValueError, match=rf"policy '{policy}': parameter '{k}'"):
        make_policy(policy, **params)


def test_bind_fills_defaults_and_keeps_given_values():
    ps = (Param("a", int, 3, "a", 0, 10), Param("b", float, 0.5, "b", 0, 1, lo_open=True))
    assert bind(ps, {"b": 1}, "x") == {"a": 3, "b": 1.0}
    with pytest.raises(ValueError, match="x has no parameter 'c' \\(it takes: a, b\\)"):
        bind(ps, {"c": 1}, "x")


@pytest.mark.parametrize(("policy", "flag", "value"), [("static", "--period-steps", "5"),
                                                       ("moeplace", "--threshold", "0.3"),
                                                       ("periodic", "--horizon-steps", "5")])
def test_cli_refuses_a_flag_the_policy_does_not_declare(policy, flag, value):
    out = cli(str(GPT_OSS_SAMPLE), *RUN, "--policy", policy, flag, value)
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in out.stderr
    assert err[0].startswith("moeplace operate: error: ") and flag in err[0] and repr(policy) in err[0]
    assert out.stdout == ""  # refused before any work started


def test_cli_list_policies_comes_from_the_registry():
    out = cli("--list-policies")  # no STREAM or --cluster needed, as --help
    assert out.returncode == 0, out.stderr
    for name, spec in POLICIES.items():
        assert any(line.startswith(name + " ") for line in out.stdout.splitlines()), name
        for p in spec.params:
            assert p.flag in out.stdout
    help_text = cli("--help").stdout
    for p in policy_params().values():
        assert p.flag in help_text


def test_cli_flag_reaches_the_policy(tmp_path):
    out = cli(str(GPT_OSS_SAMPLE), *RUN, "--policy", "periodic-preserve", "--period-steps", "400", "--json",
              str(tmp_path / "o.json"))
    assert out.returncode == 0, out.stderr
    pol = json.loads((tmp_path / "o.json").read_text())["params"]["policy"]
    assert pol == {"name": "periodic-preserve", "period_steps": 400, "preserve": True}
