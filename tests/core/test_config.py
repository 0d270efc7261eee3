"""Configuration: the shipped files load, every mistake is listed with its location, env overrides."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from config import DEMO_CONFIG, EXAMPLE_CONFIG, ConfigError, NoiseKind, config_from_mapping, load_config
from config.models import cgroup_cpu_quota, usable_cores
from server.app import pool_share
from server.scram import make_verifier

GOOD_VERIFIER = str(make_verifier("pw", salt=b"0123456789abcdef"))


def minimal() -> dict:
    return {
        "backend": {"pushdown_dsn": "postgresql://p@h/db", "restricted_dsn": "postgresql://r@h/db",
                    "ledger_dsn": "postgresql://l@h/db"},
        "analysts": {"alice": {"scram_verifier": GOOD_VERIFIER}},
    }


def test_shipped_configs_load() -> None:
    demo = load_config(DEMO_CONFIG, environ={})
    assert demo.backend.embedded
    assert set(demo.analysts) == {"alice", "bob", "admin"}
    assert demo.analysts["alice"].epsilon_budget == 10 and demo.analysts["alice"].delta_budget == 1e-4
    assert demo.analysts["bob"].epsilon_budget == 1 and demo.analysts["bob"].delta_budget == 1e-5
    assert demo.analysts["admin"].admin and not demo.analysts["alice"].admin
    assert demo.defaults.epsilon == 1.0 and demo.defaults.delta == 1e-6
    assert demo.tables["visits"].uid_column == "uid"
    assert demo.tables["visits"].columns["duration"].upper == 3600
    example = load_config(EXAMPLE_CONFIG, environ={})
    assert not example.backend.embedded
    assert example.tables["events"].uid_column == "user_id"


def test_demo_verifiers_match_the_documented_passwords() -> None:
    from server.scram import ScramClient, ScramServer, Verifier

    demo = load_config(DEMO_CONFIG, environ={})
    for name, analyst in demo.analysts.items():
        assert analyst.scram_verifier is not None
        server = ScramServer(Verifier.parse(analyst.scram_verifier))
        client = ScramClient(name)
        final = client.client_final(server.handle_client_first(client.client_first()))
        client.verify_server_final(server.verify_final(final))


def test_every_mistake_is_listed_with_its_location() -> None:
    raw = minimal()
    raw["listen"] = {"port": 70000, "prot": 1}
    raw["analysts"]["bob"] = {"scram_verifier": "hunter2", "epsilon_budget": -1}
    raw["defaults"] = {"noise": "uniform", "delta": 2}
    raw["tables"] = {"visits": {"uid_column": "uid", "columns": {"duration": {"lower": 10, "upper": 5}}},
                     "orders": {"columns": {}}}
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw, environ={})
    problems = exc.value.problems
    text = "\n".join(problems)
    expected = [
        "listen.port: Input should be less than or equal to 65535",
        "listen.prot: unknown key (a typo?)",
        "analysts.bob.scram_verifier: not a SCRAM-SHA-256 verifier",
        "analysts.bob.epsilon_budget: Input should be greater than 0",
        "defaults.noise: Input should be 'laplace' or 'gaussian'",
        "defaults.delta: Input should be less than 1",
        "tables.visits.columns.duration: lower 10 is not below upper 5",
        "tables.orders.uid_column: required but missing",
    ]
    for line in expected:
        assert any(p.startswith(line) for p in problems), f"{line!r} not in:\n{text}"
    assert len(problems) == len(expected), text


def test_backend_dsns_required_unless_embedded() -> None:
    raw = minimal()
    del raw["backend"]["restricted_dsn"]
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw, environ={})
    assert exc.value.problems == ["backend: restricted_dsn required unless embedded = true"]
    config_from_mapping({**raw, "backend": {"embedded": True}}, environ={})


def test_scram_auth_needs_a_verifier_for_every_analyst() -> None:
    raw = minimal()
    raw["analysts"]["carol"] = {}
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw, environ={})
    assert "analysts carol have no scram_verifier" in exc.value.problems[0]
    config_from_mapping({**raw, "auth_method": "trust"}, environ={})


def test_defaults_must_respect_their_caps() -> None:
    raw = minimal()
    raw["defaults"] = {"epsilon": 5, "max_epsilon_per_query": 1}
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw, environ={})
    assert exc.value.problems == ["defaults: epsilon 5.0 is above max_epsilon_per_query 1.0"]
    raw["defaults"] = {"epsilon": 1e-4}  # below the default min_epsilon, 1e-3
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw, environ={})
    assert exc.value.problems == ["defaults: epsilon 0.0001 is below min_epsilon 0.001"]
    raw["defaults"] = {"epsilon": 1e-4, "min_epsilon": 1e-5}
    assert config_from_mapping(raw, environ={}).defaults.min_epsilon == 1e-5


def test_environment_overrides() -> None:
    env = {
        "DPPROXY_LISTEN__PORT": "7000",
        "DPPROXY_DEFAULTS__NOISE": "gaussian",
        "DPPROXY_BACKEND__PUSHDOWN_DSN": "postgresql://p:secret@db/x",
        "DPPROXY_ANALYSTS__ALICE__EPSILON_BUDGET": "2.5",
        "DPPROXY_TEST_DSN": "ignored: not a config key",
        "DPPROXY_TEST_FUZZ_SEED": "ignored: the test suite's own variables",
        "OTHER": "ignored",
    }
    cfg = config_from_mapping(minimal(), environ=env)
    assert cfg.listen.port == 7000
    assert cfg.defaults.noise is NoiseKind.GAUSSIAN
    assert cfg.backend.pushdown_dsn == "postgresql://p:secret@db/x"
    assert cfg.analysts["alice"].epsilon_budget == 2.5


def test_workers_default_to_one_per_usable_core() -> None:
    """`[listen] workers`: "auto" (the default) is the cores this process may run on."""
    assert 1 <= usable_cores() <= min(64, len(os.sched_getaffinity(0)))
    assert config_from_mapping(minimal(), environ={}).listen.workers == usable_cores()
    auto = config_from_mapping(minimal(), environ={"DPPROXY_LISTEN__WORKERS": "auto"})
    assert auto.listen.workers == usable_cores()
    assert config_from_mapping(minimal(), environ={"DPPROXY_LISTEN__WORKERS": "3"}).listen.workers == 3
    for bad, problem in (("many", "listen.workers: 'many' is neither a number of processes nor "
                                  '"auto"'),
                         ("0", "listen.workers: Input should be greater than or equal to 1")):
        with pytest.raises(ConfigError) as exc:
            config_from_mapping(minimal(), environ={"DPPROXY_LISTEN__WORKERS": bad})
        assert exc.value.problems == [problem]


def test_a_cgroup_cpu_quota_limits_the_auto_workers(tmp_path: Path) -> None:
    """`docker run --cpus 1.5` sets a cgroup quota of 1.5 CPUs: "auto" starts 2 workers, not
    one per core of the host. cgroup v2 (cpu.max) and v1 (cfs_quota_us / cfs_period_us), the
    smallest along the path and its ancestors, the mount's root counting (a container
    without a cgroup namespace)."""
    fs, listing = tmp_path / "fs", tmp_path / "cgroup"

    def write(rel: str, text: str) -> None:
        (fs / rel).parent.mkdir(parents=True, exist_ok=True)
        (fs / rel).write_text(text)

    listing.write_text("0::/system.slice/app.scope\n")
    assert cgroup_cpu_quota(listing, fs) is None  # no files: no quota
    write("system.slice/app.scope/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(listing, fs) is None
    write("system.slice/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(listing, fs) == 1.5
    write("cpu.max", "50000 100000\n")
    assert cgroup_cpu_quota(listing, fs) == 0.5
    assert usable_cores(listing, fs) == 1  # (at least one)
    write("cpu.max", "max 100000\n")
    assert usable_cores(listing, fs) == min(2, len(os.sched_getaffinity(0)))

    fs = tmp_path / "v1"
    listing.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(listing, fs) is None
    write("cpu,cpuacct/cpu.cfs_quota_us", "300000\n")  # the container's own, at the root
    write("cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(listing, fs) == 3.0
    write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "100000\n")
    assert cgroup_cpu_quota(listing, fs) == 1.0
    assert cgroup_cpu_quota(tmp_path / "missing", fs) is None


def test_the_pushdown_pool_is_divided_among_workers() -> None:
    assert [pool_share(10, i, 1) for i in range(1)] == [10]
    assert [pool_share(10, i, 2) for i in range(2)] == [5, 5]
    assert [pool_share(10, i, 3) for i in range(3)] == [4, 3, 3]
    assert [pool_share(10, i, 4) for i in range(4)] == [3, 3, 2, 2]
    assert [pool_share(2, i, 4) for i in range(4)] == [1, 1, 1, 1]  # at least one each


def test_bad_environment_override_is_reported() -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(minimal(), environ={"DPPROXY_LISTEN__PORT": "many"})
    assert exc.value.problems == ["listen.port: Input should be a valid integer, unable to parse "
                                  "string as an integer"]


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "missing.toml", environ={})
    assert "cannot read the file" in exc.value.problems[0]
    bad = tmp_path / "bad.toml"
    bad.write_text("[listen\nport = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(bad, environ={})
    assert exc.value.problems[0].startswith("not valid TOML")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60)


def test_check_config_cli(tmp_path: Path) -> None:
    ok = _cli("check-config", str(EXAMPLE_CONFIG))
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    raw["tables"]["events"]["columns"]["revenue"] = {"lower": 10, "upper": 5}
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE_CONFIG.read_text().replace(
        "columns.revenue = { lower = 0, upper = 100 }", "columns.revenue = { lower = 10, upper = 5 }"
    ).replace("port = 6432", "port = -1").replace('noise = "laplace"', 'noise = "pink"'))
    out = _cli("check-config", str(bad))
    assert out.returncode == 2
    assert "tables.events.columns.revenue: lower 10 is not below upper 5" in out.stderr
    assert "listen.port:" in out.stderr and "defaults.noise:" in out.stderr


def test_serve_refuses_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[listen]\nport = 'x'\n")
    out = _cli("serve", "--config", str(bad))
    assert out.returncode == 2
    assert "listen.port" in out.stderr and "backend: required but missing" in out.stderr


def test_hash_password_cli_makes_a_usable_verifier() -> None:
    from server.scram import ScramClient, ScramServer, Verifier

    out = subprocess.run([sys.executable, "-m", "server.cli", "hash-password", "--stdin"],
                         input="s3cret\n", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    verifier = out.stdout.strip()
    cfg = config_from_mapping({**minimal(), "analysts": {"x": {"scram_verifier": verifier}}}, environ={})
    assert cfg.analysts["x"].scram_verifier == verifier
    server = ScramServer(Verifier.parse(verifier))
    client = ScramClient("s3cret")
    client.verify_server_final(server.verify_final(client.client_final(
        server.handle_client_first(client.client_first()))))
