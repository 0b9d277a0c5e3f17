"""Checkpoints: the SDK's save / resume, the on-disk checks, the guardian's facts, the admission policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.sdk import checkpoint
from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import JobCheckpointSaved, JobStarted, JobSubmitted, SubmitRequested
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.node import checkpoints

from .test_node_cores import T0, ctx, ev, fold


def state(x: int) -> dict[str, bytes]:
    return {"state.json": json.dumps({"x": x}).encode(), "weights.bin": bytes(range(256)) * 40}


def test_save_then_resume_the_latest(tmp_path: Path) -> None:
    for step in (0, 5, 10):
        c = checkpoint.save(step, state(step), where=tmp_path, keep=10)
        assert c.step == step and c.size_bytes == len(state(step)["state.json"]) + 10240
    latest = checkpoint.resume(tmp_path)
    assert latest is not None and latest.step == 10
    assert json.loads((latest.path / "state.json").read_text()) == {"x": 10}
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left behind


def test_partial_and_corrupt_newer_checkpoints_are_skipped(tmp_path: Path) -> None:
    checkpoint.save(1, state(1), where=tmp_path)
    checkpoint.save(2, state(2), where=tmp_path)
    (tmp_path / "step-000000003").mkdir()  # a copy cut short: no manifest
    (tmp_path / "step-000000003" / "state.json").write_text("{")
    corrupt = checkpoint.save(4, state(4), where=tmp_path)
    (corrupt.path / "weights.bin").write_bytes(b"\0" * 10240)  # same size, other bytes
    scans = checkpoints.scan(tmp_path)
    assert [(s.step, s.checkpoint is not None) for s in scans] == [(4, False), (3, False), (2, True), (1, True)]
    assert scans[0].reason == "weights.bin does not match its sha256"
    assert scans[1].reason == "no manifest (partial)"
    latest = checkpoint.resume(tmp_path)
    assert latest is not None and latest.step == 2


def test_retention_keeps_the_newest_good_ones(tmp_path: Path) -> None:
    for step in range(6):
        checkpoint.save(step, state(step), where=tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004", "step-000000005"]


def test_saving_a_step_again_writes_nothing_new(tmp_path: Path) -> None:
    a = checkpoint.save(7, state(7), where=tmp_path)
    b = checkpoint.save(7, state(99), where=tmp_path)  # a retried save after a crash
    assert a.sha256 == b.sha256 and json.loads((b.path / "state.json").read_text()) == {"x": 7}


def test_bad_file_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="manifest.json"):
        checkpoint.save(1, {"manifest.json": b"x"}, where=tmp_path)
    with pytest.raises(ValueError, match="plain name"):
        checkpoint.save(1, {"../x": b"x"}, where=tmp_path)


@pytest.mark.parametrize(("path", "ephemeral"), [
    ("/tmp/ckpt", True), ("/var/tmp/x", True), ("/dev/shm/run", True), ("ckpt/run1", True), ("./out", True),
    ("/mnt/shared/ckpt", False), ("/data/tmp/ckpt", False), ("s3://bucket/run", True), ("file:///nfs/c", False),
    ("file:///tmp/ck", True),
    ("ftp://x/y", True),
])
def test_ephemeral_paths(path: str, ephemeral: bool) -> None:
    assert (checkpoints.ephemeral_reason(path) is not None) == ephemeral


def test_location_under_the_root_unless_the_job_names_a_persistent_one() -> None:
    assert checkpoints.location("/ckpt", "acme", "j1") == "/ckpt/acme/j1"
    assert checkpoints.location("/ckpt/", "acme", "j1", "/mnt/nfs/me") == "/mnt/nfs/me"
    assert checkpoints.location("/ckpt", "acme", "j1", "/tmp/x") == "/ckpt/acme/j1"  # corrected


# ---------------------------------------------------------------- the guardian's facts


def guardian(tmp_path: Path, **spec: Any) -> tuple[GuardianCore, Any]:
    core = GuardianCore()
    s = parse_spec({"name": "t", "tenant": "acme", "type": "training", "command": ["x"], **spec})
    st = fold(core, core.initial_state(), ev(JobSubmitted(job_id="j", spec=s)),
              ev(JobStarted(job_id="j", node_id="n", driver="process"), at=T0))
    return core, st


def test_guardian_verifies_each_run_and_reports_new_checkpoints_once(tmp_path: Path) -> None:
    core, st = guardian(tmp_path)
    checkpoint.save(3, state(3), where=tmp_path)
    (tmp_path / "step-000000004").mkdir()  # partial
    facts = core.watch(st, "j", str(tmp_path), None, checkpoints.scan(tmp_path), T0 + 5, ctx(T0 + 5))
    assert [f.type for f in facts] == ["job.checkpoint_verified", "job.checkpoint_saved", "job.checkpoint_invalid"]
    verified = facts[0].payload
    assert verified.latest_step == 3 and [r.message for r in verified.skipped] == ["no manifest (partial)"]  # type: ignore[union-attr]
    st = fold(core, st, *facts)
    assert core.watch(st, "j", str(tmp_path), None, checkpoints.scan(tmp_path), T0 + 6, ctx(T0 + 6)) == []
    checkpoint.save(5, state(5), where=tmp_path)
    (new,) = core.watch(st, "j", str(tmp_path), None, checkpoints.scan(tmp_path), T0 + 7, ctx(T0 + 7))
    assert isinstance(new.payload, JobCheckpointSaved) and new.payload.step == 5


def test_unwritable_location_fails_the_job(tmp_path: Path) -> None:
    core, st = guardian(tmp_path)
    (f,) = core.watch(st, "j", "/proc/nope", "/proc/nope is not writable: No such file", [], T0 + 1, ctx(T0 + 1))
    assert f.type == "job.failed" and f.payload.reason.code == "checkpoint_location_unwritable"  # type: ignore[union-attr]


def test_overdue_checkpoint_is_warned_once(tmp_path: Path) -> None:
    core, st = guardian(tmp_path, checkpoint={"interval": "10s"})
    facts = core.watch(st, "j", str(tmp_path), None, [], T0 + 5, ctx(T0 + 5))
    st = fold(core, st, *facts)
    assert [f.type for f in facts] == ["job.checkpoint_verified"]
    (late,) = core.watch(st, "j", str(tmp_path), None, [], T0 + 21, ctx(T0 + 21))
    assert late.type == "job.checkpoint_overdue" and late.payload.limit_s == 20  # type: ignore[union-attr]
    st = fold(core, st, late)
    assert core.watch(st, "j", str(tmp_path), None, [], T0 + 30, ctx(T0 + 30)) == []


# ---------------------------------------------------------------- admission policy


def submit(core: AdmissionCore, path: str) -> list[Any]:
    spec = {"name": "t", "tenant": "acme", "type": "training", "command": ["x"], "checkpoint": {"path": path}}
    cmd = ev(SubmitRequested(job_id="j", spec=spec))
    return core.decide(core.initial_state(), cmd, ctx())


def test_ephemeral_checkpoint_path_is_corrected_or_rejected_by_policy() -> None:
    correct = AdmissionCore(parse_config({"tenants": {"acme": {}}}))
    out = submit(correct, "/tmp/ckpt")
    assert [e.type for e in out] == ["job.submitted", "job.admitted"]
    (w,) = out[1].payload.warnings
    assert (w.code, w.field) == ("checkpoint_ephemeral_corrected", "checkpoint.path")
    strict = AdmissionCore(parse_config({"tenants": {"acme": {"ephemeralCheckpoints": "reject"}}}))
    (rej,) = submit(strict, "ckpt/run")
    assert rej.type == "job.rejected"
    assert [(r.code, r.field) for r in rej.payload.reasons] == [("checkpoint_ephemeral", "checkpoint.path")]
    assert "container's own filesystem" in rej.payload.reasons[0].message
    assert [e.type for e in submit(strict, "/mnt/nfs/ckpt")] == ["job.submitted", "job.admitted"]


def test_stores_by_scheme(tmp_path: Path) -> None:
    local = checkpoints.store_for(tmp_path.as_uri())
    checkpoint.save(1, state(1), where=tmp_path)
    assert [s.step for s in local.scan(tmp_path.as_uri())] == [1]
    assert checkpoints.store_for(str(tmp_path)).check_writable(str(tmp_path)) is None
    with pytest.raises(ValueError, match="no checkpoint store for s3://"):
        checkpoints.store_for("s3://bucket/run")

    class Memory:
        def check_writable(self, location: str) -> str | None:
            return None

        def scan(self, location: str) -> list[checkpoints.Scanned]:
            return []

        def prune(self, location: str, keep: int) -> list[str]:
            return []
    checkpoints.register_store("mem", Memory)
    assert isinstance(checkpoints.store_for("mem://x"), Memory)


def test_verification_is_remembered_until_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = checkpoint.save(1, state(1), where=tmp_path)
    calls = []
    real = checkpoints.sha256_file
    monkeypatch.setattr(checkpoints, "sha256_file", lambda p: calls.append(p) or real(p))
    assert checkpoints.verify(c.path)[0] is not None and calls == []  # known: not hashed again
    (c.path / "weights.bin").write_bytes(b"\1" * 10240)  # same size, new bytes, new mtime
    bad, reason = checkpoints.verify(c.path)
    assert bad is None and reason == "weights.bin does not match its sha256" and calls


def test_a_location_is_judged_by_the_filesystem_it_is_on(tmp_path: Path) -> None:
    """tmpfs, ramfs, a container's overlay keep nothing, wherever they are mounted: the job's own
    path there fails its run; the verdict names the filesystem either way."""
    table = tmp_path / "mountinfo"
    (tmp_path / "fast").mkdir()
    (tmp_path / "scratch space").mkdir()
    table.write_text("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
                     f"30 22 0:27 / {tmp_path}/fast rw shared:9 - tmpfs tmpfs rw\n"
                     f"31 22 0:28 / {tmp_path}/fast rw shared:10 - ext4 /dev/sdb1 rw\n"  # mounted on top of it
                     f"32 22 0:29 / {tmp_path}/scratch\\040space rw - ramfs ramfs rw\n")
    real = checkpoints.filesystem_of
    assert real("/proc/self") == ("proc", "/proc")  # the machine's own table
    assert real(tmp_path / "not" / "there") is not None  # (its nearest existing ancestor)
    assert real(tmp_path / "fast" / "ckpt", mountinfo=str(table)) == ("ext4", f"{tmp_path}/fast")  # the top one
    assert real(tmp_path / "scratch space" / "x", mountinfo=str(table)) == ("ramfs", f"{tmp_path}/scratch space")
    assert real(tmp_path / "elsewhere", mountinfo=str(table)) == ("ext4", "/")
    assert real("/", mountinfo=str(table / "missing")) is None
    assert checkpoints.ephemeral_filesystem(("ext4", "/"), "/data") is None

    own = str(tmp_path / "ckpt")
    core, st = guardian(tmp_path, checkpoint={"path": own})
    (f,) = core.watch(st, "j", own, None, [], T0 + 1, ctx(T0 + 1), filesystem=("tmpfs", str(tmp_path)))
    assert f.type == "job.failed" and f.payload.reason.code == "checkpoint_location_ephemeral"  # type: ignore[union-attr]
    assert "tmpfs" in f.payload.reason.message and f.payload.reason.field == "checkpoint.path"  # type: ignore[union-attr]
    core, st = guardian(tmp_path)  # the root's location on tmpfs: the operator's choice, reported at start
    (v,) = core.watch(st, "j", own, None, [], T0 + 1, ctx(T0 + 1), filesystem=("tmpfs", str(tmp_path)))
    assert v.type == "job.checkpoint_verified" and v.payload.filesystem == f"tmpfs at {tmp_path}"  # type: ignore[union-attr]
    corrected = "/tmp/mine"  # under /tmp: admission corrected it, the location is the root's (reported at start)
    core, st = guardian(tmp_path, checkpoint={"path": corrected})
    (v,) = core.watch(st, "j", own, None, [], T0 + 1, ctx(T0 + 1), filesystem=("tmpfs", str(tmp_path)))
    assert v.type == "job.checkpoint_verified"
    core, st = guardian(tmp_path, checkpoint={"path": own})
    (ok,) = core.watch(st, "j", own, None, [], T0 + 1, ctx(T0 + 1), filesystem=("ext4", "/"))
    assert ok.type == "job.checkpoint_verified" and ok.payload.filesystem == "ext4 at /"  # type: ignore[union-attr]
