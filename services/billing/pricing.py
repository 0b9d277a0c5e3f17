"""Money for allocations: pure functions on decimals (never floats).

A charge line is one resource of one allocation interval: GPUs of one model, CPU cores or GiB
of memory, held for `seconds`. Its cost is quantity x seconds x price per hour / 3600, computed
at 40 digits and rounded once, half-even, to the micro-unit of the currency (`MONEY_Q`), so the
sum of stored lines is exactly the sum of the fold's lines.

A GPU share (`gpuSharing: shared`, `gpu_milli` < 1000) counts as its fraction of one GPU; a MIG
instance as its slices / 7 of its GPU (`3g.40gb` is 3/7).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Context, Decimal

from gpufleet.shared.contract.clusterconfig import PriceTable
from gpufleet.shared.contract.spec import JobSpec

MONEY_Q = Decimal("0.000001")  # micro-units of the currency
QTY_Q = Decimal("0.000001")  # GPU-, core-, GiB-seconds: micro precision
_CTX = Context(prec=40, rounding=ROUND_HALF_EVEN)
HOUR_S = Decimal(3600)
MIG_SLICES = 7  # the compute slices of a MIG-capable GPU (A100, H100)
ZERO = Decimal(0)


def seconds_between(start: datetime, end: datetime) -> Decimal:
    """Exact seconds from `start` to `end` (0 if `end` is earlier), to the microsecond."""
    td: timedelta = end - start
    us = (td.days * 86_400 + td.seconds) * 1_000_000 + td.microseconds
    return Decimal(max(us, 0)).scaleb(-6)


def month_of(t: datetime) -> str:
    """The calendar month (UTC) of `t`: `2026-05` (monthly budgets' period)."""
    t = t.astimezone(UTC)
    return f"{t.year:04d}-{t.month:02d}"


def month_start(t: datetime) -> datetime:
    """The first instant of `t`'s calendar month (UTC)."""
    t = t.astimezone(UTC)
    return datetime(t.year, t.month, 1, tzinfo=UTC)


def next_month(t: datetime) -> datetime:
    """The first instant of the calendar month (UTC) after `t`'s."""
    t = t.astimezone(UTC)
    return datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=UTC)


def mig_slices(profile: str) -> int:
    """`3g.40gb` -> 3 (the compute slices of a MIG profile); 1 when the profile says none."""
    head = profile.split("g", 1)[0]
    return int(head) if head.isdigit() and int(head) > 0 else 1


@dataclass(frozen=True)
class Usage:
    """What one replica holds: GPUs by model (a share counts as its fraction), cores, GiB."""

    gpus: tuple[tuple[str, Decimal], ...] = ()  # (model, GPUs), sorted by model
    cpu_cores: Decimal = ZERO
    memory_gib: Decimal = ZERO

    @property
    def gpu_count(self) -> Decimal:
        return sum((n for _, n in self.gpus), ZERO)


def usage(gpus: dict[str, Decimal], cpu_milli: int, memory_mib: int) -> Usage:
    return Usage(
        gpus=tuple(sorted((m, n) for m, n in gpus.items() if n > 0)),
        cpu_cores=_CTX.divide(Decimal(cpu_milli), Decimal(1000)),
        memory_gib=_CTX.divide(Decimal(memory_mib), Decimal(1024)),
    )


def share(gpu_milli: int) -> Decimal:
    return _CTX.divide(Decimal(gpu_milli), Decimal(1000))


def mig_share(profile: str) -> Decimal:
    return _CTX.divide(Decimal(mig_slices(profile)), Decimal(MIG_SLICES))


@dataclass(frozen=True)
class ChargeLine:
    """One resource of one interval: `resource` is `gpu/<model>`, `cpu` or `memory`."""

    resource: str
    quantity: Decimal  # GPUs, cores or GiB
    unit_price: Decimal  # per hour of one unit
    seconds: Decimal
    cost: Decimal
    idle_seconds: Decimal = ZERO  # GPUs only: the part of `seconds` the job was idle
    idle_cost: Decimal = ZERO

    @property
    def unit_seconds(self) -> Decimal:
        """GPU-seconds, core-seconds or GiB-seconds."""
        return _CTX.multiply(self.quantity, self.seconds).quantize(QTY_Q, context=_CTX)

    @property
    def idle_unit_seconds(self) -> Decimal:
        return _CTX.multiply(self.quantity, self.idle_seconds).quantize(QTY_Q, context=_CTX)


def cost(quantity: Decimal, unit_price: Decimal, seconds: Decimal) -> Decimal:
    """quantity x seconds x price per hour, rounded once to MONEY_Q."""
    raw = _CTX.divide(_CTX.multiply(_CTX.multiply(quantity, unit_price), seconds), HOUR_S)
    return raw.quantize(MONEY_Q, context=_CTX)


def hourly(u: Usage, prices: PriceTable) -> Decimal:
    """What the usage costs per hour (unrounded, for budgets' running estimates)."""
    total = _CTX.multiply(u.cpu_cores, prices.cpu_core_hour) + _CTX.multiply(u.memory_gib, prices.memory_gib_hour)
    for model, n in u.gpus:
        total += _CTX.multiply(n, prices.gpu(model))
    return total


def lines(u: Usage, prices: PriceTable, seconds: Decimal, idle_seconds: Decimal = ZERO) -> tuple[ChargeLine, ...]:
    """The charge lines of holding `u` for `seconds` (idle for `idle_seconds` of them)."""
    idle_seconds = min(idle_seconds, seconds)
    out = []
    for model, n in u.gpus:
        price = prices.gpu(model)
        out.append(ChargeLine(f"gpu/{model}", n, price, seconds, cost(n, price, seconds),
                              idle_seconds, cost(n, price, idle_seconds)))
    if u.cpu_cores:
        out.append(ChargeLine("cpu", u.cpu_cores, prices.cpu_core_hour, seconds,
                              cost(u.cpu_cores, prices.cpu_core_hour, seconds)))
    if u.memory_gib:
        out.append(ChargeLine("memory", u.memory_gib, prices.memory_gib_hour, seconds,
                              cost(u.memory_gib, prices.memory_gib_hour, seconds)))
    return tuple(out)


def spec_usage(spec: JobSpec, model: str) -> Usage:
    """What one replica of `spec` would hold if placed on GPUs of `model`."""
    r = spec.resources
    gpus: dict[str, Decimal] = {}
    if r.gpu:
        gpus[model] = _CTX.multiply(Decimal(r.gpu), share(r.gpu_milli))
    for profile, n in r.mig.items():
        gpus[model] = gpus.get(model, ZERO) + _CTX.multiply(Decimal(n), mig_share(profile))
    return usage(gpus, r.cpu_milli, r.memory_mib)


def estimate_cost(spec: JobSpec, prices: PriceTable, duration_s: Decimal,
                  models: tuple[str, ...]) -> dict[str, tuple[ChargeLine, ...]]:
    """The charge lines of every replica for `duration_s`, per GPU model the job could get
    (`models`; one empty name for a job without GPUs)."""
    out: dict[str, tuple[ChargeLine, ...]] = {}
    for model in models or ("",):
        per_replica = lines(spec_usage(spec, model), prices, duration_s)
        out[model] = tuple(
            ChargeLine(line.resource, _CTX.multiply(line.quantity, Decimal(spec.replicas)), line.unit_price,
                       line.seconds, line.cost * spec.replicas)
            for line in per_replica
        )
    return out


def total(lines_: tuple[ChargeLine, ...] | list[ChargeLine]) -> Decimal:
    return sum((line.cost for line in lines_), ZERO)


def money(d: Decimal) -> str:
    """A decimal as plain text, at least to the cent: 12.5 -> '12.50', 0.000123 -> '0.000123'."""
    n = d.normalize()
    exponent = n.as_tuple().exponent
    if isinstance(exponent, int) and -exponent <= 2:
        return format(d.quantize(Decimal("0.01"), context=_CTX), "f")
    return format(n, "f")


def money_key(d: Decimal) -> str:
    """One spelling per amount (100, 100.0 and 1E+2 are all '100'): for ids and comparisons."""
    return format(d.normalize(), "f")
