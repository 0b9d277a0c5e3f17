"""The contract: one frozen envelope for every message, with a typed payload per event type.

Events are facts in the past tense (`job.placed`); commands (`cmd.submit`) are what a client
asks, and are kept in the log too. The payload is a discriminated union on `type`; the
envelope carries the same `type` (a producer may omit `payload.type`).

Subjects (ids in them are validated tokens):
    fleet.cmd.<tenant>.<verb>                     commands
    fleet.evt.<tenant>.job.<job_id>.<type>        facts about one job
    fleet.evt.sys.node.<node_id>.<type>           facts about one node
    fleet.evt.sys.deadletter.<service>            messages a service could not take
    fleet.evt.sys.budget.<scope>.<name>.<type>    budget thresholds (scope: tenant | queue)
    fleet.tel.node.<node_id>.<kind>               samples (FLEET_TELEMETRY stream)
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpufleet.shared.contract.ids import check_token
from gpufleet.shared.contract.spec import JobSpec

SCHEMA_VERSION = 1
SYS_TENANT = "sys"
STREAM = "FLEET"
TELEMETRY_STREAM = "FLEET_TELEMETRY"
# a job's logs, asked of the executor of its node (request/reply, not in any stream): fleet.logs.<tenant>.<node>
LOGS_PREFIX = "fleet.logs"
SUBJECT_ROOT = "fleet"


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _JobPayload(_Payload):
    job_id: str

    @field_validator("job_id")
    @classmethod
    def _job_token(cls, v: str) -> str:
        return check_token(v, "job_id")


class _NodePayload(_Payload):
    node_id: str

    @field_validator("node_id")
    @classmethod
    def _node_token(cls, v: str) -> str:
        return check_token(v, "node_id")


class Reason(_Payload):
    """Why: a machine-readable code, the field it concerns (if any) and a sentence for people."""

    code: str
    message: str
    field: str | None = None


# ---------------------------------------------------------------- commands


class SubmitRequested(_JobPayload):
    """A client asks to run a job; the spec is raw so admission can name what is wrong with it."""

    type: Literal["cmd.submit"] = "cmd.submit"
    spec: dict[str, Any]


class CancelRequestedCmd(_JobPayload):
    """A client asks to cancel a job."""

    type: Literal["cmd.cancel"] = "cmd.cancel"
    reason: str = "cancelled by user"


# ---------------------------------------------------------------- job life cycle


class JobSubmitted(_JobPayload):
    """Admission recorded a well-formed job and its normalised spec."""

    type: Literal["job.submitted"] = "job.submitted"
    spec: JobSpec


class JobAdmitted(_JobPayload):
    """The job passed validation and tenant policy."""

    type: Literal["job.admitted"] = "job.admitted"
    warnings: tuple[Reason, ...] = ()  # what policy corrected (an ephemeral checkpoint path ...)


class JobRejected(_JobPayload):
    """The job was refused; every reason names the field or the limit."""

    type: Literal["job.rejected"] = "job.rejected"
    reasons: tuple[Reason, ...]


class JobQueued(_JobPayload):
    """The job waits for quota in its queue; the reason says which limit."""

    type: Literal["job.queued"] = "job.queued"
    queue: str
    reason: Reason | None = None


class JobQuotaReserved(_JobPayload):
    """Quota for all replicas of the job was reserved in its queue."""

    type: Literal["job.quota_reserved"] = "job.quota_reserved"
    queue: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    flavor: str | None = None  # the GPU model the quota was taken from; the placer keeps to it
    mig: dict[str, int] = Field(default_factory=dict)  # MIG profile -> instances, all replicas


class JobUnschedulable(_JobPayload):
    """No placement exists now; `filtered` counts the nodes each filter ruled out."""

    type: Literal["job.unschedulable"] = "job.unschedulable"
    reasons: tuple[Reason, ...]
    filtered: dict[str, int] = Field(default_factory=dict)
    nodes_total: int = 0


class JobBackfillReserved(_JobPayload):
    """A job at the head of the line (the first `placement.reservations` waiting) cannot be placed
    yet: it is to start on these nodes at the estimated start (running jobs' estimated ends: their
    maxRuntime, or for a job without one its similar jobs' run times; the reserved jobs ahead of
    it at theirs), and other jobs run before it only where they do not
    delay that start (backfill: EASY for one reservation, conservative for more)."""

    type: Literal["job.backfill_reserved"] = "job.backfill_reserved"
    nodes: tuple[str, ...]
    estimated_start: datetime
    # the estimates it rests on: how long the job itself is expected to run and from what
    # ("maxRuntime", "the longest of N similar runs" — the tenant's completed jobs of the same name
    # and GPUs — or the default limit), and the running job whose estimated end the start waits
    # for, with how that was estimated
    runtime_s: float | None = None
    runtime_from: str | None = None
    after_job: str | None = None
    after_from: str | None = None


class ReplicaAllocation(_Payload):
    """Exactly what one replica holds on one node."""

    replica: int
    node_id: str
    gpu_indices: tuple[int, ...] = ()
    cpu_milli: int = 0
    memory_mib: int = 0
    mig_devices: tuple[str, ...] = ()  # the UUIDs of the MIG instances it holds
    gpu_milli: int = 1000  # of each GPU in gpu_indices: < 1000 is a share of it
    numa_node: int = 0  # the NUMA node of its GPUs: where its CPUs and memory should come from


class JobPlaced(_JobPayload):
    """All replicas were given nodes and GPUs, in one compare-and-set decision."""

    type: Literal["job.placed"] = "job.placed"
    allocations: tuple[ReplicaAllocation, ...]
    attempt: int = 1


class JobStarted(_JobPayload):
    """The executor started the job's replica on its node."""

    type: Literal["job.started"] = "job.started"
    node_id: str
    replica: int = 0
    driver: str = "sim"
    attempt: int = 1
    pid: int | None = None  # process driver: the process group (its leader's pid)
    container_id: str | None = None  # docker driver


class JobDataStaging(_JobPayload):
    """The executor is copying the job's dataset (or model) into its node's local cache; the replica
    starts once every copy it needs is there. Said when the copy starts, then every 10 s or so."""

    type: Literal["job.data_staging"] = "job.data_staging"
    node_id: str
    replica: int = 0
    attempt: int = 1
    field: Literal["dataset", "model"] = "dataset"
    uri: str  # the source the copy reads
    done_bytes: int = 0
    total_bytes: int | None = None  # None: not known yet
    elapsed_s: float = 0.0


class JobDataStaged(_JobPayload):
    """The job's dataset (or model) is in its node's local cache, at `path`: copied for it now
    (`copied_bytes` in `staging_s`), or found there already (`cached`: nothing copied)."""

    type: Literal["job.data_staged"] = "job.data_staged"
    node_id: str
    replica: int = 0
    attempt: int = 1
    field: Literal["dataset", "model"] = "dataset"
    name: str  # as the spec names it (what node.datasets_cached lists)
    uri: str | None = None  # the source it was copied from (None: a bare name the node held)
    path: str  # where the workload finds it on the node (GPUFLEET_DATASET_DIR / GPUFLEET_MODEL_DIR)
    cached: bool = False
    size_bytes: int = 0
    copied_bytes: int = 0
    staging_s: float = 0.0


class JobHeartbeat(_JobPayload):
    """The job is alive (and how far it got)."""

    type: Literal["job.heartbeat"] = "job.heartbeat"
    node_id: str
    progress: float | None = None


class JobCheckpointSaved(_JobPayload):
    """A complete checkpoint was written (manifest with size and checksum)."""

    type: Literal["job.checkpoint_saved"] = "job.checkpoint_saved"
    uri: str
    step: int = 0
    size_bytes: int = 0
    sha256: str = ""
    saved_at: datetime | None = None  # when it was written (the event may come later)


class JobCheckpointVerified(_JobPayload):
    """At the start of a run: the checkpoint location is writable and persistent, and this is the
    latest good checkpoint in it (partial or corrupt newer ones skipped, each with its reason)."""

    type: Literal["job.checkpoint_verified"] = "job.checkpoint_verified"
    location: str
    attempt: int = 1
    latest_uri: str | None = None
    latest_step: int | None = None
    skipped: tuple[Reason, ...] = ()  # code "checkpoint_invalid", field = the URI, message = why
    filesystem: str | None = None  # what the location is on, as the guardian saw it: "ext4 at /data"


class JobCheckpointInvalid(_JobPayload):
    """A checkpoint in the job's location is partial or corrupt: it will never be resumed from."""

    type: Literal["job.checkpoint_invalid"] = "job.checkpoint_invalid"
    uri: str
    step: int
    reason: str


class JobCheckpointOverdue(_JobPayload):
    """The job's last checkpoint is older than its policy allows: a failure now loses that much."""

    type: Literal["job.checkpoint_overdue"] = "job.checkpoint_overdue"
    age_s: float
    limit_s: float
    last_uri: str | None = None


class JobPreemptionRequested(_JobPayload):
    """Quota asks for the job's resources back; the guardian may checkpoint it first."""

    type: Literal["job.preemption_requested"] = "job.preemption_requested"
    reason: Reason
    by_job_id: str | None = None
    grace_s: float = 30.0


class JobPreempted(_JobPayload):
    """The job was stopped to give its resources to another."""

    type: Literal["job.preempted"] = "job.preempted"
    reason: Reason


class JobRequestRefused(_JobPayload):
    """A command about the job was refused and changed nothing (a duplicate submit, a cancel of
    another tenant's or an ended job); published under the requesting tenant."""

    type: Literal["job.request_refused"] = "job.request_refused"
    command: Literal["submit", "cancel"]
    reasons: tuple[Reason, ...]
    command_id: str | None = None


class JobCancelRequested(_JobPayload):
    """Cancellation of a placed or running job was accepted; the executor stops it."""

    type: Literal["job.cancel_requested"] = "job.cancel_requested"
    reason: str
    requested_by: str


ExitReason = Literal["completed", "error", "cancelled", "preempted", "timeout", "node_lost", "killed"]


class JobExited(_JobPayload):
    """A replica's process ended; its resources are free."""

    type: Literal["job.exited"] = "job.exited"
    node_id: str
    replica: int = 0
    exit_code: int
    reason: ExitReason = "completed"
    runtime_s: float = 0.0
    attempt: int = 1
    # GPUs where a process of the replica still held memory after it was stopped: they are not
    # free until telemetry's occupancy check passes (`node.gpu_cleared`)
    unclean_gpus: tuple[int, ...] = ()
    # the latest good checkpoint in the job's location as the node saw it at the end (training jobs)
    checkpoint_uri: str | None = None
    checkpoint_step: int | None = None
    checkpoint_saved_at: datetime | None = None
    # why a replica that never started could not (its dataset could not be staged: code
    # data_staging_failed, field dataset | model): the job fails with this reason
    detail: Reason | None = None


class JobSucceeded(_JobPayload):
    """The job ended well."""

    type: Literal["job.succeeded"] = "job.succeeded"


class JobFailed(_JobPayload):
    """The job ended badly and will not be retried."""

    type: Literal["job.failed"] = "job.failed"
    reason: Reason
    exit_code: int | None = None


class JobCancelled(_JobPayload):
    """The job was cancelled; it holds nothing any more."""

    type: Literal["job.cancelled"] = "job.cancelled"
    reason: str


class JobResumeRequested(_JobPayload):
    """The job is to run again, from this checkpoint (or from the start)."""

    type: Literal["job.resume_requested"] = "job.resume_requested"
    checkpoint_uri: str | None = None
    reason: Reason
    lost_work_s: float = 0.0
    # the run this resume starts (the one before + 1): a copy of the event, folded again, is
    # recognised as old (None in logs written before it was added: then each resume counts)
    attempt: int | None = Field(default=None, ge=2)


class JobResized(_JobPayload):
    """An elastic job's world size changes (the placer's decision): its run `attempt` stops with a
    checkpoint (SIGTERM, then its grace) and the guardian starts the next from that checkpoint at
    `to_replicas`. code `grow`: capacity nothing waiting needs; `shrink`: a job holding quota
    (`for_job`) needs the room of its replicas above its min."""

    type: Literal["job.resized"] = "job.resized"
    from_replicas: int = Field(ge=1)
    to_replicas: int = Field(ge=1)
    attempt: int = Field(ge=1)  # the run that stops
    reason: Reason
    for_job: str | None = None


def resumed_attempt(current: int, p: JobResumeRequested) -> int | None:
    """The attempt a resume starts, given the current one; None when it is a copy of an old one."""
    if p.attempt is None:
        return current + 1
    return p.attempt if p.attempt > current else None


class JobIdleDetected(_JobPayload):
    """The job's GPUs stayed below the utilisation threshold for `idle_s`."""

    type: Literal["job.idle_detected"] = "job.idle_detected"
    gpu_util_pct: float
    idle_s: float
    node_id: str | None = None
    threshold_pct: float | None = None


class JobIdleEnded(_JobPayload):
    """The job's GPUs are busy again after `job.idle_detected`."""

    type: Literal["job.idle_ended"] = "job.idle_ended"
    node_id: str | None = None
    gpu_util_pct: float = 0.0


class JobGpuStarved(_JobPayload):
    """The job's GPUs are underused while its CPUs are saturated (`cause: cpu`) or it waits on
    I/O (`cause: io`): its input pipeline cannot feed the GPUs."""

    type: Literal["job.gpu_starved"] = "job.gpu_starved"
    node_id: str
    cause: Literal["cpu", "io"]
    gpu_util_pct: float
    cpu_util_pct: float  # of the CPUs the job asked for (100 = all of them busy)
    iowait_pct: float = 0.0  # share of the window its processes waited on block I/O
    window_s: float
    message: str = ""


# ---------------------------------------------------------------- nodes


class MigDevice(_Payload):
    """One MIG instance of a GPU in MIG mode: its profile (`1g.10gb`) and the UUID to pin it."""

    profile: str
    uuid: str


class GpuDevice(_Payload):
    """One GPU and where it sits in the node's topology. A GPU in MIG mode is not handed out
    whole: its instances (`mig_devices`) are."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    nvlink_island: int = 0
    pcie_switch: int = 0
    numa_node: int = 0
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()


class NodeInventory(_Payload):
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuDevice, ...] = ()
    numa_nodes: int = 1
    labels: dict[str, str] = Field(default_factory=dict)  # rack, leaf, spine, shape, ...
    taints: tuple[str, ...] = ()  # jobs that do not tolerate one of these are not placed here
    driver: str = "sim"


class NodeRegistered(_NodePayload):
    """A node joined (or re-joined) with this inventory."""

    type: Literal["node.registered"] = "node.registered"
    inventory: NodeInventory


class NodeHeartbeat(_NodePayload):
    """The node's executor is alive (sent to FLEET_TELEMETRY, not the main log)."""

    type: Literal["node.heartbeat"] = "node.heartbeat"
    running_jobs: tuple[str, ...] = ()
    # one executor hosting many (sim) nodes beats for all of them in one message
    also_nodes: tuple[str, ...] = ()


class NodeLost(_NodePayload):
    """Heartbeats stopped past the lease; the node's jobs are gone."""

    type: Literal["node.lost"] = "node.lost"
    reason: str = "heartbeat lease expired"


class NodeCordoned(_NodePayload):
    """The node takes no new work (what runs there goes on, unless `drain`)."""

    type: Literal["node.cordoned"] = "node.cordoned"
    reason: str
    # drained (`gpufleet node drain`, like `kubectl drain`): each job running there is also asked
    # to run again elsewhere, from its last checkpoint, without spending one of its retries
    drain: bool = False


class NodeUncordoned(_NodePayload):
    """The node takes work again."""

    type: Literal["node.uncordoned"] = "node.uncordoned"


class NodeDatasetsCached(_NodePayload):
    """The datasets (and models) in the node's local cache, as the executor last saw them on disk
    (a data-locality fact): each named as job specs name it. Said at start and on every change."""

    type: Literal["node.datasets_cached"] = "node.datasets_cached"
    datasets: tuple[str, ...]


class NodeGpuUnhealthy(_NodePayload):
    """A GPU showed ECC / XID errors; it takes no new work."""

    type: Literal["node.gpu_unhealthy"] = "node.gpu_unhealthy"
    gpu_index: int
    reason: str
    xid: int | None = None
    ecc_uncorrected: int | None = None


class NodeGpuCleared(_NodePayload):
    """An occupancy check passed on a quarantined GPU: no process outside a running job holds
    its memory any more, so it takes new work again."""

    type: Literal["node.gpu_cleared"] = "node.gpu_cleared"
    gpu_index: int
    reason: str = "occupancy check passed"
    # an operator returned it to service (`gpufleet gpu return`, the actor says who): every hold
    # is lifted, an unhealthy report's included; telemetry's check lifts only zombie and unclean
    returned: bool = False


class NodeGpuZombieDetected(_NodePayload):
    """GPU memory held by a process of no running job; the GPU is quarantined."""

    type: Literal["node.gpu_zombie_detected"] = "node.gpu_zombie_detected"
    gpu_index: int
    pid: int
    used_mib: int
    process_name: str = ""
    last_job_id: str | None = None  # the job whose process it was, when known (left after a kill)


class DeadLetter(_Payload):
    """A service could not take a message; it was terminated, and this says why."""

    type: Literal["sys.dead_letter"] = "sys.dead_letter"
    service: str
    subject: str
    stream_seq: int
    reason: str
    data_excerpt: str = ""
    # who sent it and about which job, when they can be read (the subject names the tenant of a
    # command; the raw payload its job id)
    tenant: str | None = None
    about_job: str | None = None  # (not `job_id`: a dead letter is not one of the job's events)


class CapacityCommitted(_Payload):
    """The last event of each commit of a service's capacity decisions (the placer's placements):
    written in the same atomic batch, on the service's own literal subject. The compare-and-set
    guard of those decisions is this subject's last sequence: a commit goes in only if no other
    instance committed since the state it was decided on saw (docs/log.md). A literal subject
    makes that check one lookup; a wildcard over every job's `placed` subject made the server
    match every job the stream holds (44.5 ms a check at 50,000 jobs)."""

    type: Literal["sys.capacity_committed"] = "sys.capacity_committed"
    service: str  # the deciding service (`placer`): the subject's last token
    events: int = Field(ge=1)  # the events of its atomic batch, all just before it

    @field_validator("service")
    @classmethod
    def _service_token(cls, v: str) -> str:
        return check_token(v, "service")


# ---------------------------------------------------------------- billing


class _BudgetPayload(_Payload):
    """A budget of a tenant or a queue (the cluster config's `budgets`)."""

    scope: Literal["tenant", "queue"]
    budget: str  # the tenant's or the queue's name
    amount: Decimal  # the budget, in `currency`
    currency: str = "USD"
    spent: Decimal  # charged so far, open allocations up to `occurred_at` included
    threshold_pct: int
    policy: Literal["warn", "hold"] = "warn"
    # a monthly budget (`period: month`): the calendar month (UTC) spent in, `2026-05`; else absent
    period: str | None = Field(default=None, pattern=r"^[0-9]{4}-[0-9]{2}$")

    @field_validator("budget")
    @classmethod
    def _budget_token(cls, v: str) -> str:
        return check_token(v, "budget")


class BudgetThresholdReached(_BudgetPayload):
    """A budget's spending reached one of its warning thresholds (said once per threshold)."""

    type: Literal["budget.threshold_reached"] = "budget.threshold_reached"


class BudgetExceeded(_BudgetPayload):
    """A budget's spending reached 100 % (or a threshold above it); with policy `hold`, admission
    refuses new submits of the tenant or queue while the config keeps this amount."""

    type: Literal["budget.exceeded"] = "budget.exceeded"


# ---------------------------------------------------------------- autoscaler


class ReportLoadCmd(_JobPayload):
    """The load an inference service (its job id) is under, as its load balancer or the service
    itself measured it over the last `window_s`: the autoscaler's input. A command, so a tenant's
    client may publish it on `fleet.cmd.<tenant>.report_load`."""

    type: Literal["cmd.report_load"] = "cmd.report_load"
    rps: float = Field(ge=0, le=1e9, allow_inf_nan=False)  # requests per second, all replicas together
    p99_ms: float | None = Field(default=None, ge=0, le=3_600_000, allow_inf_nan=False)
    window_s: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)


class JobScaled(_JobPayload):
    """The autoscaler changed an inference service's replicas (`job_id`: the service), and why:
    the metrics it saw against their targets. `added` / `removed`: the replica jobs."""

    type: Literal["job.scaled"] = "job.scaled"
    from_replicas: int = Field(ge=0)
    to_replicas: int = Field(ge=0)
    reason: Reason  # code: initial | load | latency | idle | scale_to_zero | from_zero | bounds | cancelled
    rps: float | None = None
    p99_ms: float | None = None
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class NodeProvisionRequested(_NodePayload):
    """The autoscaler asked a node pool's provider for a node (`node_id`, named in advance); it
    registers like any node when it is up, after about `ready_after_s`."""

    type: Literal["node.provision_requested"] = "node.provision_requested"
    pool: str
    provider: str
    inventory: NodeInventory  # the pool's node shape
    ready_after_s: float = 0.0
    reason: Reason  # code: unschedulable | below_min
    for_jobs: tuple[str, ...] = ()  # the waiting jobs it is for


class NodeRemovalRequested(_NodePayload):
    """The autoscaler asked a pool's provider to remove a drained node (cordoned, nothing on it),
    or one it asked for that never registered within the pool's provisionTimeout (given up on)."""

    type: Literal["node.removal_requested"] = "node.removal_requested"
    pool: str
    provider: str
    reason: Reason  # code: idle | provision_timeout | lost


class NodeDeregistered(_NodePayload):
    """The node left the cluster on purpose (its provider removed it): not lost, gone."""

    type: Literal["node.deregistered"] = "node.deregistered"
    reason: str = "removed"


Payload = Annotated[
    Union[  # noqa: UP007 - a discriminated union reads clearer spelled out
        SubmitRequested, CancelRequestedCmd,
        JobSubmitted, JobAdmitted, JobRejected, JobQueued, JobQuotaReserved, JobUnschedulable, JobPlaced,
        JobDataStaging, JobDataStaged, JobStarted, JobHeartbeat, JobCheckpointSaved, JobCheckpointVerified, JobCheckpointInvalid,
        JobCheckpointOverdue, JobPreemptionRequested, JobPreempted,
        JobRequestRefused, JobCancelRequested, JobExited, JobSucceeded, JobFailed, JobCancelled, JobResumeRequested,
        JobResized,
        JobIdleDetected, JobIdleEnded, JobGpuStarved, JobBackfillReserved,
        NodeRegistered, NodeHeartbeat, NodeLost, NodeCordoned, NodeUncordoned, NodeGpuUnhealthy, NodeDatasetsCached,
        NodeGpuZombieDetected, NodeGpuCleared,
        DeadLetter, CapacityCommitted,
        BudgetThresholdReached, BudgetExceeded,
        ReportLoadCmd, JobScaled, NodeProvisionRequested, NodeRemovalRequested, NodeDeregistered,
    ],
    Field(discriminator="type"),
]

PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.model_fields["type"].default: cls
    for cls in get_args(get_args(Payload)[0])  # Annotated[Union[...], Field] -> the payload classes
}
EVENT_TYPES: tuple[str, ...] = tuple(PAYLOAD_TYPES)
# The contract's one definition of a job's ends. Terminal: the job is over, only late copies follow.
TERMINAL_JOB_TYPES = frozenset({"job.succeeded", "job.failed", "job.cancelled", "job.rejected"})
# A run that ended: the job holds nothing now (a preempted job may be resumed: placed again later).
RUN_ENDED_JOB_TYPES = TERMINAL_JOB_TYPES | {"job.preempted"}


class Envelope(BaseModel):
    """Every message on the bus."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str = Field(min_length=26, max_length=26, description="ULID, also sent as Nats-Msg-Id")
    type: str
    schema_version: int = SCHEMA_VERSION
    occurred_at: datetime
    tenant: str
    causation_id: str | None = None
    correlation_id: str | None = None
    actor: str
    payload: Payload

    # `payload.type` may be omitted: it is the envelope's `type`. Filled in by these two rather than
    # by a model validator: a "before" validator has pydantic turn a JSON document into Python
    # objects first and validate those (job.placed 10.7 -> 7.0 us without it, every process, every
    # event); an event that names its payload's type, as every service writes them, is read
    # straight from its bytes, and only one that leaves it out is read twice.
    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Envelope:
        return super().model_validate(_payload_typed(obj), **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Envelope:
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            if not any(e["type"] == "union_tag_not_found" and tuple(e["loc"]) == ("payload",) for e in exc.errors()):
                raise
            doc = _payload_typed(json.loads(json_data))  # (it is JSON: the tag alone was missing)
            return super().model_validate_json(json.dumps(doc), **kwargs)

    @model_validator(mode="after")
    def _consistent(self) -> Envelope:
        if self.payload.type != self.type:
            raise ValueError(f"type {self.type!r} does not match payload.type {self.payload.type!r}")
        check_token(self.tenant, "tenant")
        if self.schema_version > SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is newer than this code ({SCHEMA_VERSION})")
        return self

    @property
    def job_id(self) -> str | None:
        return getattr(self.payload, "job_id", None)

    @property
    def node_id(self) -> str | None:
        return getattr(self.payload, "node_id", None)

    def subject(self) -> str:
        return subject_for(self.tenant, self.payload)

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def _payload_typed(doc: Any) -> Any:
    """An envelope's document with its `type` as its payload's where the payload names none."""
    if isinstance(doc, dict):
        payload = doc.get("payload")
        if isinstance(payload, dict) and "type" not in payload and isinstance(doc.get("type"), str):
            return {**doc, "payload": {**payload, "type": doc["type"]}}
    return doc


def subject_for(tenant: str, payload: Payload) -> str:
    kind = payload.type
    area, _, short = kind.partition(".")
    if area == "cmd":
        return f"{SUBJECT_ROOT}.cmd.{tenant}.{short}"
    # (every job.* payload is a _JobPayload, every node.* one a _NodePayload)
    if area == "job" and isinstance(payload, _JobPayload):
        return f"{SUBJECT_ROOT}.evt.{tenant}.job.{payload.job_id}.{short}"
    if area == "node" and isinstance(payload, _NodePayload):
        if kind == "node.heartbeat":
            return f"{SUBJECT_ROOT}.tel.node.{payload.node_id}.heartbeat"
        return f"{SUBJECT_ROOT}.evt.{SYS_TENANT}.node.{payload.node_id}.{short}"
    if isinstance(payload, DeadLetter):
        return f"{SUBJECT_ROOT}.evt.{SYS_TENANT}.deadletter.{payload.service}"
    if isinstance(payload, CapacityCommitted):
        return capacity_subject(payload.service)
    if area == "budget" and isinstance(payload, _BudgetPayload):
        return f"{SUBJECT_ROOT}.evt.{SYS_TENANT}.budget.{payload.scope}.{payload.budget}.{short}"
    raise ValueError(f"no subject for {kind}")


def capacity_subject(service: str) -> str:
    """Where `service`'s commits of capacity decisions end (`sys.capacity_committed`): its guard."""
    return f"{SUBJECT_ROOT}.evt.{SYS_TENANT}.capacity.{service}"


def parse_envelope(data: bytes | str) -> Envelope:
    return Envelope.model_validate_json(data)


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)
