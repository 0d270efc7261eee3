"""The configuration schema: pydantic models that reject unknown keys and impossible values."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dp_core.mechanism_choices import NoiseKind as NoiseKind
from dp_core.mechanism_choices import SelectionKind as SelectionKind

_SCRAM_VERIFIER = re.compile(
    r"^SCRAM-SHA-256\$(?P<iterations>\d+):(?P<salt>[A-Za-z0-9+/=]+)"
    r"\$(?P<stored_key>[A-Za-z0-9+/=]+):(?P<server_key>[A-Za-z0-9+/=]+)$"
)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class AuthMethod(StrEnum):
    SCRAM_SHA_256 = "scram-sha-256"
    TRUST = "trust"


class Accountant(StrEnum):
    BASIC = "basic"
    RDP = "rdp"


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=6432, ge=0, le=65535)
    max_connections: int = Field(default=200, ge=1, description=(
        "sessions that have logged in, all analysts together (53300 beyond it)"))
    max_unauthenticated: int = Field(default=64, ge=1, le=10_000, description=(
        "connections still in their start-up or login, on top of max_connections: sockets "
        "that never log in cannot take the slots of those who do"))
    max_message_size: int = Field(default=64 * 1024 * 1024, ge=1024)
    startup_timeout: float = Field(default=10.0, gt=0, description=(
        "seconds a connection has to finish its start-up and login (as Postgres' "
        "authentication_timeout)"))
    idle_timeout: float = Field(default=0.0, ge=0, description=(
        "seconds a session may sit with nothing running and no input before it is closed "
        "(57P05); 0 disables it"))
    shutdown_grace: float = Field(
        default=30.0, ge=0,
        description="on SIGTERM, how long running queries may finish before sessions close")
    workers: int = Field(default_factory=lambda: usable_cores(), ge=1, le=64, description=(
        "processes serving clients, or \"auto\" (the default): one per core this process may "
        "run on, within its cgroup CPU quota. Above 1, a supervisor process accepts "
        "connections and hands each to the worker with the fewest, so the proxy uses that "
        "many cores; the pushdown pool's connections are divided among the workers"))

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, v: object) -> object:
        if v == "auto":
            return usable_cores()
        if isinstance(v, str):
            raise ValueError(f'{v!r} is neither a number of processes nor "auto"')
        return v


def usable_cores(cgroup: Path = Path("/proc/self/cgroup"),
                 cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int:
    """What `workers = "auto"` starts: the cores this process may run on (its CPU affinity,
    which a container's cpuset narrows), fewer where a cgroup CPU quota allows less time
    (`docker run --cpus 1.5`: 2), at most 64."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup, cgroup_fs)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, min(n, 64))


def cgroup_cpu_quota(cgroup: Path, cgroup_fs: Path) -> float | None:
    """The CPU time this process's cgroups allow, in CPUs (quota / period), the smallest
    along its cgroup and their ancestors, or None where none sets a quota.

    `cgroup` lists the process's cgroups (/proc/self/cgroup): `0::/path` for cgroup v2,
    whose limit is `cpu.max` ("max 100000" or "150000 100000") under `cgroup_fs`/path;
    `N:cpu,cpuacct:/path` for v1, whose limit is `cpu.cfs_quota_us` (-1: none) over
    `cpu.cfs_period_us` under the controller's mount. A container without a cgroup
    namespace sees its host's path but has its own cgroup mounted at the root, so the
    root counts too."""
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = Path(path.lstrip("/"))
        dirs = [rel, *rel.parents]
        if controllers == "":
            for d in dirs:
                with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
                    quota, period = (cgroup_fs / d / "cpu.max").read_text().split()
                    if quota != "max":
                        quotas.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):
            mount = cgroup_fs / controllers
            if not mount.is_dir():
                mount = cgroup_fs / "cpu"
            for d in dirs:
                with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
                    quota_us = int((mount / d / "cpu.cfs_quota_us").read_text())
                    if quota_us > 0:
                        quotas.append(quota_us / int((mount / d / "cpu.cfs_period_us").read_text()))
    return min(quotas) if quotas else None


class MetricsConfig(_Strict):
    """The operator's HTTP endpoint: Prometheus metrics at /metrics, a health check at /healthz."""

    port: int | None = Field(default=None, ge=0, le=65535, description="unset: no endpoint")
    host: str = "127.0.0.1"


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


class StatementLog(StrEnum):
    ALL = "all"
    """Every statement, successful pass-through ones too (a line per statement at any rate)."""
    DP = "dp"
    """What the proxy answers itself (DP queries, EXPLAIN, dp.* settings, admin functions),
    refusals, and pass-through statements that fail."""
    NONE = "none"


class LogConfig(_Strict):
    """Logs on standard error: one line per statement (never query text, values or results)."""

    format: LogFormat = LogFormat.TEXT
    statements: StatementLog = StatementLog.DP


class TLSConfig(_Strict):
    cert_file: Path | None = None
    key_file: Path | None = None
    require: bool = False

    @model_validator(mode="after")
    def _pair(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.require and self.cert_file is None:
            raise ValueError("require = true needs cert_file and key_file")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class BackendConfig(_Strict):
    """Where the data lives. `embedded` starts a private Postgres (the demo)."""

    embedded: bool = False
    pushdown_dsn: str | None = None
    restricted_dsn: str | None = None
    ledger_dsn: str | None = Field(default=None, description=(
        "the role that owns the ledger schema: no analyst SQL, pass-through or pushdown, ever "
        "runs as it"))
    analyst_role_prefix: str = Field(default="dp_analyst_", description=(
        "each analyst's pass-through session logs in to the backend as its own role, this "
        "prefix and the analyst's name (init-backend creates them), so that Postgres keeps "
        "analysts apart"))
    analyst_login_secret: str | None = Field(default=None, description=(
        "the key from which each analyst role's backend password is derived (HMAC-SHA-256 of "
        "the analyst's name); by default the restricted_dsn's password"))
    pushdown_wait: float = Field(default=10.0, gt=0, le=3600, description=(
        "seconds a DP query waits for a free pushdown connection before it fails with 53300 "
        "(nothing charged)"))
    pushdown_pool_size: int = Field(default=10, ge=1, le=1000, description=(
        "connections for DP queries' pushdowns, opened as needed: the proxy's total, divided "
        "among its workers (at least one each)"))
    statement_timeout: float = Field(default=300.0, gt=0)
    pushdown_work_mem: str | None = Field(
        default=None, pattern=r"^[0-9]+(kB|MB|GB)$",
        description="work_mem of pushdown sessions (default: the server's); more memory avoids "
                    "spilling per-user aggregates to disk but can turn parallel plans serial")
    pushdown_split: int = Field(
        default=4, ge=1, le=64,
        description="a DP query over a large table runs as up to this many pushdowns at once, "
                    "each over one range of the uid (in one snapshot), on pool connections that "
                    "are free; 1 never splits")
    pushdown_prefilter: bool = Field(
        default=False,
        description="split pushdowns of per-user aggregates (ANON_*, COUNT(DISTINCT uid), "
                    "DISTINCT keys) pick each user's kept groups from its rows before "
                    "aggregating them: faster where users have many more groups than they "
                    "keep, slower where they have few (bench/RESULTS.md). The operator's "
                    "choice for every query alike: chosen per query from the data, the time "
                    "an answer takes would tell it")
    pushdown_split_min_rows: int = Field(
        default=200_000, ge=0,
        description="split only when the table whose uid the query groups by has at least this "
                    "many rows (pg_class.reltuples, kept by ANALYZE and VACUUM)")
    ledger_schema: str = "dpproxy"

    @field_validator("ledger_schema", "analyst_role_prefix")
    @classmethod
    def _schema_name(cls, v: str) -> str:
        if not _IDENTIFIER.match(v):
            raise ValueError(f"{v!r} is not a plain SQL identifier")
        return v

    @model_validator(mode="after")
    def _dsns(self) -> Self:
        if not self.embedded:
            missing = [n for n in ("pushdown_dsn", "restricted_dsn", "ledger_dsn")
                       if getattr(self, n) is None]
            if missing:
                raise ValueError(f"{' and '.join(missing)} required unless embedded = true")
        return self


class AnalystConfig(_Strict):
    """One person who may connect. Passwords are stored only as SCRAM-SHA-256 verifiers."""

    scram_verifier: str | None = None
    admin: bool = False
    epsilon_budget: PositiveFloat = 1.0
    delta_budget: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 1e-6
    accountant: Accountant = Accountant.BASIC
    refresh_days: int | None = Field(
        default=None, ge=1, description="renew the budget this many days after the last reset")
    max_connections: int = Field(default=40, ge=1, le=10_000, description=(
        "the analyst's sessions at once: the CONNECTION LIMIT of its backend role, which "
        "Postgres enforces across every proxy (53300 beyond it)"))
    max_dp_queries: int = Field(default=2, ge=1, le=1000, description=(
        "the analyst's DP queries running at once in one proxy worker: more wait for one of "
        "them to end (53300 after backend.pushdown_wait), so that one analyst cannot hold "
        "every pushdown connection"))

    @field_validator("scram_verifier")
    @classmethod
    def _verifier(cls, v: str | None) -> str | None:
        if v is not None and not _SCRAM_VERIFIER.match(v):
            raise ValueError(
                "not a SCRAM-SHA-256 verifier (plain passwords are never stored: "
                "make one with `dp-proxy hash-password`)"
            )
        return v


class DefaultsConfig(_Strict):
    """What a DP query uses when it does not say otherwise, and the caps it may not exceed."""

    epsilon: PositiveFloat = 1.0
    delta: Probability = 1e-6
    max_groups_contributed: int = Field(default=1, ge=1, le=10_000)
    noise: NoiseKind = NoiseKind.LAPLACE
    partition_selection: SelectionKind = Field(default=SelectionKind.LAPLACE, description=(
        "how grouped queries pick the groups they release: \"laplace\" (τ-thresholding of "
        "a noisy user count, paper §3.5) or \"truncated_geometric\" (Desfontaines et al. "
        "2022: fewer users needed for the same ε, δ; used where the user count is not "
        "itself released)"))
    max_rows_contributed: Literal["auto"] | Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        default="auto", description=(
            "T of row-level aggregates (plain COUNT, SUM, AVG, ...): the rows of one user "
            "they count in all its groups together, or \"auto\": chosen per query from DP "
            "statistics of the data (a tenth of its ε)"))
    max_epsilon_per_query: PositiveFloat = 10.0
    max_delta_per_query: Probability = 1e-3
    max_groups_contributed_limit: int = Field(default=100, ge=1, le=10_000)
    min_epsilon: float = Field(default=1e-3, ge=sys.float_info.min, allow_inf_nan=False,
                               description=(
        "the least ε a query (its OPTIONS or `SET dp.epsilon`) may ask for: near-free "
        "queries would make probing, one answer or failure per guess, cost nothing"))
    max_row_work_passes: float = Field(default=32.0, ge=1.0, le=1e6, description=(
        "the most work a DP query's expressions may do on one row, in passes over the row's "
        "values (dp_core.cost): above it the query is refused before anything runs"))
    max_row_work_bytes: float = Field(default=1024.0, ge=0.0, le=1e9, description=(
        "with max_row_work_passes: the most work per row beyond those passes, in bytes "
        "(lpad(x, 100) produces up to 400)"))
    release_quantum_ms: float = Field(default=50.0, ge=0.0, le=60_000.0, description=(
        "each charged DP outcome (an answer, or the failure of a charged query) is sent at "
        "the next multiple of this after the query arrived, so that its time says less about "
        "the data (0: as soon as it is ready)"))
    answer_reuse: Literal["off", "analyst", "all"] = Field(default="analyst", description=(
        "a DP question asked again, over tables whose data has not changed, gets the answer "
        "already released, at no cost: the same analyst's (\"analyst\"), anyone's (\"all\"), "
        "or never (\"off\")"))
    answer_reuse_hours: float = Field(default=24.0, gt=0.0, le=24.0 * 366, description=(
        "how long a released answer may be reused (its tables' data unchanged)"))
    clock_granularity_minutes: int = Field(default=60, ge=0, le=24 * 60, description=(
        "a DP query's now(), current_date and the other clock values are read at the start "
        "of their quantum of this many minutes of the session's local time (a divisor of a "
        "day's 1440: quanta start at midnight), so that a dashboard's relative dates ask the "
        "same question again within it; 0 reads the exact time"))

    @model_validator(mode="after")
    def _whole_quanta(self) -> Self:
        g = self.clock_granularity_minutes
        if g and (24 * 60) % g:
            raise ValueError(f"clock_granularity_minutes {g} does not divide a day's 1440 "
                             "minutes (quanta start at midnight: 1, 5, 15, 30, 60, 1440, ...)")
        return self

    @model_validator(mode="after")
    def _within_caps(self) -> Self:
        if self.epsilon > self.max_epsilon_per_query:
            raise ValueError(
                f"epsilon {self.epsilon} is above max_epsilon_per_query {self.max_epsilon_per_query}"
            )
        if self.epsilon < self.min_epsilon:
            raise ValueError(f"epsilon {self.epsilon} is below min_epsilon {self.min_epsilon}")
        if self.min_epsilon > self.max_epsilon_per_query:
            raise ValueError(f"min_epsilon {self.min_epsilon} is above max_epsilon_per_query "
                             f"{self.max_epsilon_per_query}")
        if self.delta > self.max_delta_per_query:
            raise ValueError(
                f"delta {self.delta} is above max_delta_per_query {self.max_delta_per_query}"
            )
        if self.max_groups_contributed > self.max_groups_contributed_limit:
            raise ValueError(
                f"max_groups_contributed {self.max_groups_contributed} is above "
                f"max_groups_contributed_limit {self.max_groups_contributed_limit}"
            )
        return self


MAX_PUBLIC_KEYS = 100_000
"""The most keys a public key domain (or the product of several a query groups by) may list."""


class ColumnBounds(_Strict):
    """One column of a protected table: bounds of a numeric column (each row's value for plain
    (row-level) aggregates, each user's per-group value for ANON_* ones, is clamped to them),
    and/or its public key domain (grouping by it releases every listed key, no partition
    selection)."""

    lower: float | None = Field(default=None, allow_inf_nan=False)
    upper: float | None = Field(default=None, allow_inf_nan=False)
    public_keys: list[str | int] | None = Field(default=None, description=(
        "the column's every key, as Postgres prints them (its ::text)"))
    public_keys_from: str | None = Field(default=None, description=(
        "\"schema.table.column\" (or \"table.column\", in public) of a public table holding "
        "the column's keys"))

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if (self.lower is None) != (self.upper is None):
            raise ValueError("lower and upper come together")
        if self.lower is not None and self.upper is not None and not self.lower < self.upper:
            raise ValueError(f"lower {_num(self.lower)} is not below upper {_num(self.upper)}")
        for bound in (self.lower, self.upper):
            # (as a query's written bounds: dp_core.aggregates.check_bound)
            if bound is not None and bound != 0 and not 1e-100 <= abs(bound) <= 1e100:
                raise ValueError(f"bound {_num(bound)}: 0 or of a magnitude within 1e-100 "
                                 "and 1e100")
        if self.public_keys is not None and self.public_keys_from is not None:
            raise ValueError("public_keys and public_keys_from exclude each other")
        if self.lower is None and self.public_keys is None and self.public_keys_from is None:
            raise ValueError("give bounds (lower, upper) or public keys")
        if self.public_keys is not None and not 0 < len(self.public_keys) <= MAX_PUBLIC_KEYS:
            raise ValueError(f"public_keys lists 1 to {MAX_PUBLIC_KEYS} keys")
        if self.public_keys_from is not None:
            parts = self.public_keys_from.split(".")
            if len(parts) not in (2, 3) or not all(_IDENTIFIER.match(p) for p in parts):
                raise ValueError("public_keys_from is \"schema.table.column\" or "
                                 "\"table.column\" of plain identifiers")
        return self

    @property
    def bounded(self) -> bool:
        return self.lower is not None

    def keys_source(self) -> tuple[str, str, str] | None:
        """(schema, table, column) of `public_keys_from`."""
        if self.public_keys_from is None:
            return None
        parts = self.public_keys_from.split(".")
        return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("public", parts[0], parts[1])


class TotalBudgetConfig(_Strict):
    """A privacy budget every answer also charges, shared by all analysts: it bounds what all of
    them together learn about one person (of the database, or of one protected table)."""

    epsilon: PositiveFloat
    delta: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 1e-5


class TableConfig(_Strict):
    """A protected table: every row belongs to the user in `uid_column`."""

    schema_: str = Field(default="public", alias="schema")
    uid_column: str
    columns: dict[str, ColumnBounds] = Field(default_factory=dict)
    total_budget: TotalBudgetConfig | None = Field(default=None, description=(
        "a budget every answer that reads this table also charges, shared by all analysts"))

    @field_validator("uid_column", "schema_")
    @classmethod
    def _ident(cls, v: str) -> str:
        if not _IDENTIFIER.match(v):
            raise ValueError(f"{v!r} is not a plain SQL identifier")
        return v

    @field_validator("columns")
    @classmethod
    def _column_names(cls, v: dict[str, ColumnBounds]) -> dict[str, ColumnBounds]:
        bad = [name for name in v if not _IDENTIFIER.match(name)]
        if bad:
            raise ValueError(f"not plain SQL identifiers: {', '.join(bad)}")
        return v


class PublicConfig(_Strict):
    """The unprotected tables analysts may read (`init-backend` grants them, and nothing else
    but the protected tables): DP queries may join them, and pass-through reads them."""

    tables: list[str] = Field(default_factory=list, description=(
        "tables as \"schema.table\" (or \"table\", in public)"))
    schemas: list[str] = Field(default_factory=list, description=(
        "schemas whose every table (now and when init-backend runs again) analysts may read"))

    @field_validator("tables")
    @classmethod
    def _table_names(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if not all(_IDENTIFIER.match(part) for part in t.split(".", 1))]
        if bad:
            raise ValueError(f"public tables are \"schema.table\" or \"table\" of plain "
                             f"identifiers: {', '.join(bad)}")
        return v

    @field_validator("schemas")
    @classmethod
    def _schema_names(cls, v: list[str]) -> list[str]:
        bad = [name for name in v if not _IDENTIFIER.match(name)]
        if bad:
            raise ValueError(f"schema names must be plain identifiers: {', '.join(bad)}")
        return v

    def qualified(self) -> list[tuple[str, str]]:
        """(schema, table) of each public table."""
        return [tuple(t.split(".", 1)) if "." in t else ("public", t)  # type: ignore[misc]
                for t in self.tables]


class Config(_Strict):
    """The whole proxy configuration (one TOML file plus DPPROXY_* overrides)."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    tls: TLSConfig = Field(default_factory=TLSConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    auth_method: AuthMethod = AuthMethod.SCRAM_SHA_256
    backend: BackendConfig
    analysts: dict[str, AnalystConfig]
    defaults: DefaultsConfig = Field(default_factory=DefaultsConfig)
    tables: dict[str, TableConfig] = Field(default_factory=dict)
    public: PublicConfig = Field(default_factory=PublicConfig)
    total_budget: TotalBudgetConfig | None = Field(default=None, description=(
        "a budget every answer also charges, shared by all analysts"))

    @field_validator("analysts")
    @classmethod
    def _analyst_names(cls, v: dict[str, AnalystConfig]) -> dict[str, AnalystConfig]:
        if not v:
            raise ValueError("at least one analyst is needed")
        bad = [name for name in v if not _IDENTIFIER.match(name)]
        if bad:
            raise ValueError(f"analyst names must be plain identifiers: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _analyst_role_names(self) -> Self:
        prefix = self.backend.analyst_role_prefix
        long = sorted(n for n in self.analysts if len((prefix + n).encode()) > 63)
        if long:
            raise ValueError(f"analyst names too long for a backend role name (with the prefix "
                             f"{prefix!r}, at most 63 bytes): {', '.join(long)}")
        return self

    @field_validator("tables")
    @classmethod
    def _table_names(cls, v: dict[str, TableConfig]) -> dict[str, TableConfig]:
        bad = [name for name in v if not _IDENTIFIER.match(name)]
        if bad:
            raise ValueError(f"table names must be plain identifiers: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _verifiers_for_scram(self) -> Self:
        if self.auth_method is AuthMethod.SCRAM_SHA_256:
            missing = sorted(n for n, a in self.analysts.items() if a.scram_verifier is None)
            if missing:
                raise ValueError(
                    f"auth_method is scram-sha-256 but analysts {', '.join(missing)} "
                    "have no scram_verifier"
                )
        return self

    @model_validator(mode="after")
    def _public_keys_readable(self) -> Self:
        public = set(self.public.qualified())
        for name, t in self.tables.items():
            for column, c in t.columns.items():
                source = c.keys_source()
                if source is not None and (source[0], source[1]) not in public \
                        and source[0] not in self.public.schemas:
                    raise ValueError(
                        f"tables.{name}.columns.{column}.public_keys_from: "
                        f"{source[0]}.{source[1]} is not a public table (public.tables or "
                        "public.schemas): analysts could not read the keys it releases")
        return self

    def total_budgets(self) -> dict[str, TotalBudgetConfig]:
        """The total budgets by scope: "database", and "schema.table" of each protected table
        that has one."""
        out = {"database": self.total_budget} if self.total_budget is not None else {}
        out.update({f"{t.schema_}.{name}": t.total_budget for name, t in self.tables.items()
                    if t.total_budget is not None})
        return out

    def total_scopes(self, tables: Iterable[str]) -> list[str]:
        """The total budgets an answer reading the protected `tables` ("schema.table") charges,
        in the order their rows are locked."""
        return sorted(({"database"} | set(tables)) & self.total_budgets().keys())

    def protected(self, schema: str, table: str) -> TableConfig | None:
        """The policy of `schema.table` if it is protected."""
        t = self.tables.get(table)
        return t if t is not None and t.schema_ == schema else None


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)
