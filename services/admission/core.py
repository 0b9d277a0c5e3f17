"""Admission: validate submitted jobs against the spec, the cluster and the tenant's policy.

folds: jobs (tenant, phase), each tenant's submit bucket and pending count, node capacity
decides: job.submitted + job.admitted | job.rejected (reasons naming the field or the limit),
         job.cancel_requested | job.request_refused

Every reason has a code (`unknown_queue`, `rate_limited`, ...), the field it concerns and a
sentence. A command about an existing job that cannot be honoured (a second submit with the
same job id, a cancel of another tenant's job) is refused with `job.request_refused`, which
changes nothing about the job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from gpufleet.shared.contract.clusterconfig import (
    MAX_PAYLOAD_BYTES,
    ClusterConfig,
    TenantPolicy,
    source_refusal,
)
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import (
    SYS_TENANT,
    BudgetExceeded,
    CancelRequestedCmd,
    Envelope,
    JobAdmitted,
    JobCancelRequested,
    JobRejected,
    JobRequestRefused,
    JobSubmitted,
    NodeDeregistered,
    NodeInventory,
    NodeRegistered,
    Reason,
    SubmitRequested,
)
from gpufleet.shared.contract.ids import is_ulid, ulid_time_ms
from gpufleet.shared.contract.spec import JobSpec, parse_spec
from gpufleet.shared.node.checkpoints import ephemeral_reason
from gpufleet.shared.node.cluster import pool_shapes
from gpufleet.shared.runtime.loop import BaseCore, Ctx, InvalidMessage
from gpufleet.shared.runtime.retention import EndedJobs

PENDING, PLACED, CANCELLING, ENDED = "pending", "placed", "cancelling", "ended"
MIB = 1024


@dataclass
class SubmitBucket:
    """A token bucket, updated from the log's own times (job.submitted's occurred_at)."""

    tokens: float
    at_s: float


@dataclass(slots=True)
class AdmissionJob:
    """What admission knows of one job: one record, kept for the window after the job ends (a
    second submit of its id is refused, a cancel is told it ended), then forgotten
    (`AdmissionState.end`)."""

    tenant: str
    phase: str = PENDING
    submit_cmd: str | None = None  # the command that submitted it
    # submitted, admitted not yet seen: a publish cut short between the two is finished on redelivery
    unadmitted: bool = False
    waiting: bool = False  # counted in its tenant's `pending` (submitted, neither placed nor ended)


@dataclass
class AdmissionState:
    jobs: dict[str, AdmissionJob] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # ended jobs are forgotten after a window of log time
    buckets: dict[str, SubmitBucket] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # tenant -> jobs submitted, not placed / ended
    nodes: dict[str, NodeInventory] = field(default_factory=dict)
    # (tenant | queue, name) -> the budget amounts billing said were exceeded (docs/billing.md)
    budgets_exceeded: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # the largest node in each dimension, derived from `nodes` (None: to compute again); on the
    # state it derives from, so a restored or rolled-back state never reads another's
    capacity: Capacity | None = field(default=None, compare=False, repr=False)

    def set_waiting(self, rec: AdmissionJob, on: bool) -> None:
        """Count a tenant's jobs that wait (submitted, neither placed nor ended)."""
        if on != rec.waiting:
            rec.waiting = on
            self.pending[rec.tenant] = max(0, self.pending.get(rec.tenant, 0) + (1 if on else -1))

    def end(self, job_id: str, at: datetime) -> None:
        """The job ended (or was rejected): its record stays, ended, for the window; the records of
        the jobs that ended more than the window ago are forgotten now (a submit of a forgotten
        ULID id is refused by its time: `AdmissionCore._submit`)."""
        rec = self.jobs.get(job_id)
        if rec is not None:
            self.set_waiting(rec, False)
            rec.phase, rec.unadmitted = ENDED, False
        for gone in self.ended.add(job_id, at) if rec is not None else self.ended.prune(at.timestamp()):
            self.jobs.pop(gone, None)


@dataclass(frozen=True)
class Capacity:
    """The largest node of the cluster in each dimension (per replica fit)."""

    models: frozenset[str]
    cpu_milli: int
    memory_mib: int
    gpus_by_model: dict[str, int]
    gpu_memory_mib_by_model: dict[str, int]
    mig_by_profile: dict[str, int]  # the most instances of the profile on one node


def capacity(nodes: dict[str, NodeInventory]) -> Capacity:
    gpus: dict[str, int] = {}
    gpu_mem: dict[str, int] = {}
    mig: dict[str, int] = {}
    for inv in nodes.values():
        per: dict[str, int] = {}
        per_mig: dict[str, int] = {}
        for g in inv.gpus:
            gpu_mem[g.model] = max(gpu_mem.get(g.model, 0), g.memory_mib)
            if g.mig_enabled:
                for m in g.mig_devices:
                    per_mig[m.profile] = per_mig.get(m.profile, 0) + 1
            else:
                per[g.model] = per.get(g.model, 0) + 1
        for model, n in per.items():
            gpus[model] = max(gpus.get(model, 0), n)
        for profile, n in per_mig.items():
            mig[profile] = max(mig.get(profile, 0), n)
    return Capacity(
        models=frozenset(gpu_mem), cpu_milli=max((n.cpu_milli for n in nodes.values()), default=0),
        memory_mib=max((n.memory_mib for n in nodes.values()), default=0), gpus_by_model=gpus,
        gpu_memory_mib_by_model=gpu_mem, mig_by_profile=mig,
    )


def _r(code: str, message: str, field: str | None = None) -> Reason:
    return Reason(code=code, message=message, field=field)


class AdmissionCore(BaseCore[AdmissionState]):
    name = "admission"
    subjects = (
        "fleet.cmd.*.*",
        "fleet.evt.sys.node.*.registered", "fleet.evt.sys.node.*.deregistered",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.rejected",
        "fleet.evt.*.job.*.placed",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.cancel_requested", "fleet.evt.*.job.*.preempted",
        "fleet.evt.sys.budget.*.*.exceeded",
    )
    state_format = 2  # one record per job (AdmissionJob)

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        # the node shapes the pools may add (max > 0): capacity the cluster can grow to, counted
        # as if registered (keys cannot clash with node ids: a node id has no '.')
        self._pool_nodes = {f"nodePools.{name}": inv for name, inv in pool_shapes(self.config).items()}

    def initial_state(self) -> AdmissionState:
        return AdmissionState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: AdmissionState, env: Envelope) -> AdmissionState:
        t = env.type
        p = env.payload
        if isinstance(p, NodeRegistered):
            state.nodes[p.node_id] = p.inventory
            state.capacity = None
            return state
        if isinstance(p, NodeDeregistered):  # removed by its pool's provider: no longer capacity
            if state.nodes.pop(p.node_id, None) is not None:
                state.capacity = None
            return state
        if isinstance(p, BudgetExceeded):  # a monthly budget's amount is keyed with its month: `800@2026-05`
            state.budgets_exceeded.setdefault((p.scope, p.budget), set()).add(
                _amount_key(p.amount) + (f"@{p.period}" if p.period else ""))
            return state
        job_id = env.job_id
        if job_id is None or t.startswith("cmd."):
            return state
        rec = state.jobs.get(job_id)
        if t == "job.submitted":
            if rec is None:
                rec = state.jobs[job_id] = AdmissionJob(env.tenant, submit_cmd=env.causation_id or None,
                                                        unadmitted=True)
                # an inference service (autoscale) is never placed: its replicas are the jobs that wait
                if not (isinstance(p, JobSubmitted) and p.spec.autoscale is not None):
                    state.set_waiting(rec, True)
                policy = self.config.policy(env.tenant) or self.config.defaults
                at = env.occurred_at.timestamp()
                b = state.buckets.get(env.tenant)
                tokens = policy.submit_burst if b is None else min(
                    policy.submit_burst, b.tokens + (at - b.at_s) * policy.submit_rate_per_s)
                state.buckets[env.tenant] = SubmitBucket(tokens - 1, at)
        elif t == "job.admitted":
            if rec is not None:
                rec.unadmitted = False
        elif t == "job.rejected":
            if rec is None:
                state.jobs[job_id] = AdmissionJob(env.tenant, submit_cmd=env.causation_id or None)
            state.end(job_id, env.occurred_at)
        elif t == "job.placed":
            if rec is not None and rec.phase in (PENDING, CANCELLING):
                if rec.phase == PENDING:
                    rec.phase = PLACED
                state.set_waiting(rec, False)
        elif t == "job.cancel_requested":
            if rec is not None and rec.phase in (PENDING, PLACED):
                rec.phase = CANCELLING
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.end(job_id, env.occurred_at)
        return state

    # ------------------------------------------------------------ decide

    def decide(self, state: AdmissionState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        p = env.payload
        if isinstance(p, SubmitRequested):
            return self._submit(state, env, p, ctx)
        if isinstance(p, CancelRequestedCmd):
            return self._cancel(state, env, p, ctx)
        return []

    def on_invalid(self, state: AdmissionState, bad: InvalidMessage, ctx: Ctx) -> list[Envelope]:
        """A command that is not the contract is answered on its job's own subject, when the
        subject names its tenant and the raw payload a job id: `job.rejected` (`invalid_envelope`,
        one reason per field) for a submit of a job it does not know, `job.request_refused` for
        anything else (a known job is not ended by a broken copy of a command about it). The
        tenant answered is the subject's: the one whose credentials published it."""
        toks = bad.subject.split(".")
        if bad.tenant is None or bad.job_id is None or toks[1] != "cmd" or bad.tenant == SYS_TENANT:
            return []
        verb = toks[3] if len(toks) > 3 else "?"
        if verb not in ("submit", "cancel"):
            return []  # (a load report answers no one)
        reasons = tuple(Reason(code="invalid_envelope", message=f"{field}: {msg}", field=field)
                        for field, msg in bad.errors[:20])
        known = state.jobs.get(bad.job_id)
        payload: JobRejected | JobRequestRefused
        if verb == "submit" and known is None:
            payload = JobRejected(job_id=bad.job_id, reasons=reasons)
        else:
            payload = JobRequestRefused(job_id=bad.job_id, command=verb, reasons=reasons)  # type: ignore[arg-type]
        return [Envelope(event_id=bad.event_id, type=payload.type, occurred_at=ctx.now, tenant=bad.tenant,
                         actor=ctx.actor, correlation_id=bad.job_id, payload=payload)]

    def _refuse(self, ctx: Ctx, env: Envelope, job_id: str, command: str, reason: Reason) -> list[Envelope]:
        return [ctx.emit(JobRequestRefused(
            job_id=job_id, command=command, reasons=(reason,), command_id=env.event_id,  # type: ignore[arg-type]
        ), tenant=env.tenant)]

    def _submit(self, state: AdmissionState, env: Envelope, p: SubmitRequested, ctx: Ctx) -> list[Envelope]:
        known = state.jobs.get(p.job_id)
        if known is not None:
            if known.submit_cmd == env.event_id:
                if known.unadmitted and known.phase == PENDING:
                    # job.submitted was written, job.admitted not (a publish cut short): finish
                    # the decision, with the id the first try gave it
                    return [ctx.emit(JobAdmitted(job_id=p.job_id), key="1")]
                return []  # the same command again (a redelivery): decided already
            return self._refuse(ctx, env, p.job_id, "submit", _r(
                "duplicate_job_id", f"job {p.job_id} exists already; a new job needs a new id", "job_id"))
        if is_ulid(p.job_id) and ulid_time_ms(p.job_id) / 1000 < ctx.now.timestamp() - state.ended.retention_s:
            # ended jobs are forgotten after the window: an id from before it may be one of them
            return self._refuse(ctx, env, p.job_id, "submit", _r(
                "job_id_expired", f"job id {p.job_id} is a ULID from before the {state.ended.retention_s / 3600:g} h "
                "the cluster remembers ended jobs for; a new job needs a new id", "job_id"))
        spec, reasons = self._check(state, env, p, ctx)
        if reasons or spec is None:
            return [ctx.emit(JobRejected(job_id=p.job_id, reasons=tuple(reasons)))]
        if spec.priority_class is not None:  # recorded as the number the class stands for
            spec = spec.model_copy(update={"priority": self.config.priority_classes[spec.priority_class]})
        return [
            ctx.emit(JobSubmitted(job_id=p.job_id, spec=spec)),
            ctx.emit(JobAdmitted(job_id=p.job_id, warnings=self._warnings(spec))),
        ]

    def _warnings(self, spec: JobSpec) -> tuple[Reason, ...]:
        path = spec.checkpoint.path if spec.checkpoint else None
        why = ephemeral_reason(path) if path else None
        if why is None:
            return ()
        return (_r("checkpoint_ephemeral_corrected", f"checkpoint.path {why}; checkpoints go to the cluster's "
                   "persistent checkpoint root instead (GPUFLEET_CHECKPOINT_DIR)", "checkpoint.path"),)

    def refusals(self, state: AdmissionState, tenant: str, spec: dict[str, object], ctx: Ctx) -> list[Reason]:
        """Why a submit of `spec` by `tenant` would be rejected now (none: it would be admitted) —
        the same checks as a real submit, for `gpufleet estimate` to say before it is sent."""
        env = ctx.emit(SubmitRequested(job_id="estimate", spec=spec), tenant=tenant, key="estimate")
        return self._check(state, env, SubmitRequested(job_id="estimate", spec=spec), ctx)[1]

    def _check(self, state: AdmissionState, env: Envelope, p: SubmitRequested, ctx: Ctx,
               ) -> tuple[JobSpec | None, list[Reason]]:
        """The parsed spec and every reason the job cannot be admitted (none: it can)."""
        size = len(json.dumps(p.spec, default=str))
        if size > MAX_PAYLOAD_BYTES:
            return None, [_r("payload_too_large", f"the spec is {size} bytes; the limit is {MAX_PAYLOAD_BYTES}", "spec")]
        policy = self.config.policy(env.tenant)
        if policy is None:
            known = ", ".join(sorted(self.config.tenants)) or "none"
            return None, [_r("unknown_tenant", f"tenant {env.tenant!r} is not in the cluster config "
                             f"(known: {known})", "tenant")]
        try:
            spec = parse_spec(p.spec)
        except SpecError as exc:
            # one reason per broken field, each naming its own
            return None, [_r("invalid_spec", f"{f}: {m}", f) for f, m in exc.errors]
        if spec.tenant != env.tenant:
            return spec, [_r("tenant_mismatch", f"spec.tenant {spec.tenant!r} is not the submitting tenant {env.tenant!r}",
                       "tenant")]
        if spec.priority_class is not None:
            if spec.priority_class not in self.config.priority_classes:
                known = ", ".join(sorted(self.config.priority_classes)) or "none"
                return spec, [_r("unknown_priority_class", f"priority class {spec.priority_class!r} is not in the "
                           f"cluster config (known: {known})", "priorityClass")]
            if spec.priority != 0:
                return spec, [_r("invalid_spec", "give priority or priorityClass, not both", "priorityClass")]
        reasons = (self._policy_reasons(spec, policy) + self._cluster_reasons(state, spec, policy)
                   + self._budget_reasons(state, spec, ctx.now))
        if reasons:
            return spec, reasons
        return spec, self._limit_reasons(state, env.tenant, policy, ctx)

    def _policy_reasons(self, spec: JobSpec, policy: TenantPolicy) -> list[Reason]:
        out = []
        if policy.queues is not None and spec.queue not in policy.queues:
            out.append(_r("unknown_queue", f"queue {spec.queue!r} is not one of {spec.tenant}'s queues "
                          f"({', '.join(policy.queues)})", "queue"))
        elif self.config.queues and spec.queue not in self.config.queues:
            # a cluster that configures queues has no implicit, unlimited one
            out.append(_r("unknown_queue", f"queue {spec.queue!r} is not in the cluster config "
                          f"(known: {', '.join(sorted(self.config.queues))})", "queue"))
        if spec.type not in policy.allowed_job_types:
            out.append(_r("job_type_not_allowed", f"job type {spec.type!r} is not allowed for {spec.tenant} "
                          f"({', '.join(policy.allowed_job_types)})", "type"))
        most = spec.sizes[-1]  # (an elastic job at its max: it may grow to it)
        if spec.resources.gpu * most > policy.max_gpus_per_job:
            out.append(_r("too_many_gpus", f"{spec.resources.gpu * most} GPUs ({most} x {spec.resources.gpu}"
                          f"{' at its elastic max' if spec.elastic else ''}) is over {spec.tenant}'s limit of "
                          f"{policy.max_gpus_per_job} per job", "elastic.max" if spec.elastic else "resources.gpu"))
        if policy.allowed_gpu_models:
            bad = [m for m in spec.resources.gpu_models if m not in policy.allowed_gpu_models]
            if bad:
                out.append(_r("gpu_model_not_allowed", f"GPU model {', '.join(bad)} is not allowed for {spec.tenant} "
                              f"({', '.join(policy.allowed_gpu_models)})", "resources.gpuModels"))
        if spec.image is not None and not policy.image_allowed(spec.image):
            out.append(_r("image_not_allowed", f"image {spec.image!r} matches none of {spec.tenant}'s allowed images",
                          "image"))
        for name in ("dataset", "model"):
            uri = getattr(spec, name)
            if uri and "://" in uri:
                refused = source_refusal(uri, self.config.data_sources_for(spec.tenant))
                if refused is not None:
                    out.append(_r("data_source_not_allowed", f"{name} {uri}: {refused}", name))
        path = spec.checkpoint.path if spec.checkpoint else None
        why = ephemeral_reason(path) if path else None
        if why is not None and policy.ephemeral_checkpoints == "reject":
            out.append(_r("checkpoint_ephemeral", f"checkpoint.path {why}: checkpoints there vanish with the "
                          "container (leave it out to get a persistent location)", "checkpoint.path"))
        limit = policy.checkpoint_required_after_s
        if (limit is not None and spec.type in ("training", "finetune") and spec.runtime_limit_s > limit
                and spec.checkpoint is None):
            out.append(_r("checkpoint_required", f"a {spec.type} job that may run {spec.runtime_limit_s / 3600:.1f}h "
                          f"(over {limit / 3600:.1f}h) must set checkpoint", "checkpoint"))
        return out

    def _cluster_reasons(self, state: AdmissionState, spec: JobSpec, policy: TenantPolicy) -> list[Reason]:
        """Requests no node of the cluster could ever hold (checked once nodes are known)."""
        if not state.nodes:
            return []
        if state.capacity is None:
            state.capacity = capacity({**state.nodes, **self._pool_nodes})
        cap = state.capacity
        r = spec.resources
        out = []
        unknown = [m for m in r.gpu_models if m not in cap.models]
        if unknown:
            where = "node nor node pool" if self._pool_nodes else "node"
            has = "the cluster and its node pools have" if self._pool_nodes else "the cluster has"
            out.append(_r("gpu_model_unknown", f"no {where} has GPU model {', '.join(unknown)} ({has} "
                          f"{', '.join(sorted(cap.models)) or 'no GPUs'})", "resources.gpuModels"))
        if r.cpu_milli > cap.cpu_milli:
            out.append(_r("exceeds_node", f"cpu {r.cpu_milli / 1000:g} per replica is more than the largest node "
                          f"has ({cap.cpu_milli / 1000:g})", "resources.cpu"))
        if r.memory_mib > cap.memory_mib:
            out.append(_r("exceeds_node", f"memory {r.memory_mib // MIB}Gi per replica is more than the largest node "
                          f"has ({cap.memory_mib // MIB}Gi)", "resources.memory"))
        for profile, n in r.mig.items():
            most = cap.mig_by_profile.get(profile, 0)
            if not most:
                out.append(_r("mig_profile_unknown", f"no node has MIG instances of profile {profile} (the cluster has "
                              f"{', '.join(sorted(cap.mig_by_profile)) or 'none'})", "resources.mig"))
            elif n > most:
                out.append(_r("exceeds_node", f"mig {profile}: {n} per replica is more than any node has ({most}); "
                              "use replicas for more", "resources.mig"))
        models = [m for m in (r.gpu_models or tuple(cap.models)) if m in cap.models]
        if r.gpu and models and r.gpu > (most_gpus := max(cap.gpus_by_model.get(m, 0) for m in models)):
            out.append(_r("exceeds_node", f"gpu {r.gpu} per replica is more than any node has "
                          f"({most_gpus} whole GPUs); use replicas for more",
                          "resources.gpu"))
        if r.gpu_memory_mib and models and r.gpu_memory_mib > max(cap.gpu_memory_mib_by_model[m] for m in models):
            out.append(_r("exceeds_node", f"gpuMemory {r.gpu_memory_mib // MIB}Gi is more than any GPU has", "resources.gpuMemory"))
        return out

    def _budget_reasons(self, state: AdmissionState, spec: JobSpec, now: datetime) -> list[Reason]:
        """Budget hold: a tenant or queue whose budget (policy `hold`, at the amount the config has
        now; for a monthly budget, in the month of `now`) billing said was exceeded takes no new
        jobs; a raised budget, or the next month, lifts the hold."""
        out = []
        for scope, name, field_ in (("tenant", spec.tenant, "tenant"), ("queue", spec.queue, "queue")):
            budget = self.config.budgets.of(scope, name)
            if budget is None or budget.policy != "hold" or not state.budgets_exceeded:
                continue
            period = budget.period_of(now)
            if _amount_key(budget.amount) + (f"@{period}" if period else "") in state.budgets_exceeded.get(
                    (scope, name), ()):
                until = "the month ends or it is raised" if period else "it is raised"
                out.append(_r("budget_exceeded", f"the budget of {scope} {name} ({_amount_key(budget.amount)} "
                              f"{self.config.prices.currency}{' in ' + period if period else ''}) is exceeded and "
                              f"its policy is hold: no new jobs until {until} (budgets in the cluster config)",
                              field_))
        return out

    def _limit_reasons(self, state: AdmissionState, tenant: str, policy: TenantPolicy, ctx: Ctx) -> list[Reason]:
        if state.pending.get(tenant, 0) >= policy.max_pending_jobs:
            return [_r("too_many_pending", f"{tenant} has {state.pending[tenant]} jobs waiting; the limit is "
                       f"{policy.max_pending_jobs} (maxPendingJobs)")]
        b = state.buckets.get(tenant)
        if b is not None:
            tokens = min(policy.submit_burst, b.tokens + (ctx.now.timestamp() - b.at_s) * policy.submit_rate_per_s)
            if tokens < 1:
                return [_r("rate_limited", f"{tenant} submits faster than {policy.submit_rate_per_s:g}/s "
                           f"(burst {policy.submit_burst}; submitRatePerS)")]
        return []

    def _cancel(self, state: AdmissionState, env: Envelope, p: CancelRequestedCmd, ctx: Ctx) -> list[Envelope]:
        known = state.jobs.get(p.job_id)
        if known is None:
            return self._refuse(ctx, env, p.job_id, "cancel", _r("unknown_job", f"no job {p.job_id}", "job_id"))
        # `fleet.cmd.sys.cancel` is the admin's subject (only the admin may publish there): an
        # operator's cancel of any tenant's job, recorded under the job's tenant as the admin's
        admin = env.tenant == SYS_TENANT
        if known.tenant != env.tenant and not admin:
            # the same words as for an unknown job: another tenant's jobs are not to be probed
            return self._refuse(ctx, env, p.job_id, "cancel", _r("unknown_job", f"no job {p.job_id}", "job_id"))
        if known.phase == CANCELLING:
            return []  # asked already
        if known.phase == ENDED:
            return self._refuse(ctx, env, p.job_id, "cancel", _r("already_ended", f"job {p.job_id} has ended"))
        # Admission may lag behind the job: it only asks. The placer, which alone places jobs,
        # cancels one it has not placed; the executor stops one that runs; the guardian ends it.
        return [ctx.emit(JobCancelRequested(job_id=p.job_id, reason=p.reason, requested_by=env.actor),
                         tenant=known.tenant)]


def _amount_key(d: Decimal) -> str:
    """One spelling per amount (100, 100.0, 1E+2 -> '100'), as billing keys its budget events."""
    return format(d.normalize(), "f")
