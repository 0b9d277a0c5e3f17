"""The wire contract of `gpufleet logs`: a request for a run's log, and the reply (request/reply on
`fleet.logs.<tenant>.<node_id>`, answered by the executor of the node: services/executor/logs.py;
docs/clients.md, section 7; `logs.request.schema.json` and `logs.reply.schema.json` in docs/schemas)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.shared.contract.events import LOGS_PREFIX
from gpufleet.shared.contract.ids import TOKEN_LEN_MAX

DEFAULT_LIMIT = 256 * 1024
MAX_LIMIT = 1024 * 1024


def logs_subject(tenant: str, node_id: str) -> str:
    """Where a log request for a run on `node_id` goes (the executor listens on `fleet.logs.*.*`)."""
    return f"{LOGS_PREFIX}.{tenant}.{node_id}"


class LogRequest(BaseModel):
    """Which run's log, and which part: from byte `offset`, or the last `tail` lines; at most `limit` bytes."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=TOKEN_LEN_MAX, pattern=r"^[A-Za-z0-9_-]+$")
    replica: int = Field(default=0, ge=0)
    attempt: int = Field(default=1, ge=1)
    offset: int = Field(default=0, ge=0, description="the first byte to read")
    tail: int | None = Field(default=None, ge=0, description="the last N lines instead of an offset")
    limit: int = Field(default=DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="at most this many bytes")


class LogReply(BaseModel):
    """A part of a run's log: `data` starts at byte `offset`; ask again from `next` (until `running`
    is false and `next` equals `size`)."""

    job_id: str
    replica: int
    attempt: int
    node_id: str
    driver: str = Field(description="process, docker or sim (a few lines rendered from the job's events)")
    data: str = Field(description="UTF-8, bad bytes replaced")
    offset: int = Field(description="of data's first byte")
    next: int = Field(description="ask again from here")
    size: int = Field(description="of the whole log so far")
    running: bool = Field(description="the run still goes on: more may come")
