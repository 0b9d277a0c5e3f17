"""Operator commands (the admin only): cordon, uncordon and drain a node; return a GPU to service;
requeue a job.

Each is a fact in the log with the operator as its actor (`admin/<user>`): `node.cordoned`
(with `drain`), `node.uncordoned`, `node.gpu_cleared` (with `returned`), `job.resume_requested`
(reason `requeued`); `explain` and the
dashboard show them like any other event.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpufleet.cli.common import DataDir, JsonOut, _print_json, _run, _with_fleet, app

node_app = typer.Typer(no_args_is_help=True, help="Operator: take a node out of service, or back (the admin only).")
gpu_app = typer.Typer(no_args_is_help=True, help="Operator: a GPU back into service (the admin only).")
job_app = typer.Typer(no_args_is_help=True, help="Operator: a job placed again (the admin only).")
app.add_typer(node_app, name="node")
app.add_typer(gpu_app, name="gpu")
app.add_typer(job_app, name="job")

Reason = Annotated[str, typer.Option(help="why (in the log with your name)")]


def _state(payload: Any, data_dir: str | None, as_json: bool, said: str) -> None:
    _said(_run(_with_fleet(data_dir, lambda f: f.operator_fact(payload))), as_json, said)


def _said(env: Any, as_json: bool, said: str) -> None:
    """The fact in the log: as JSON, or a line that names it and who stated it."""
    if as_json:
        _print_json({"event_id": env.event_id, "type": env.type, "actor": env.actor,
                     **env.payload.model_dump(mode="json", exclude={"type"})})
    else:
        typer.echo(f"{said} ({env.type} {env.event_id}, by {env.actor})")


@node_app.command("cordon")
def cordon(node: str, reason: Reason = "cordoned by an operator", data_dir: DataDir = None,
           as_json: JsonOut = False) -> None:
    """No new work on NODE; what runs there goes on (`kubectl cordon`)."""
    from gpufleet.shared.contract.events import NodeCordoned

    _state(NodeCordoned(node_id=node, reason=reason), data_dir, as_json, f"node {node} cordoned: no new work")


@node_app.command("uncordon")
def uncordon(node: str, data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """NODE takes new work again."""
    from gpufleet.shared.contract.events import NodeUncordoned

    _state(NodeUncordoned(node_id=node), data_dir, as_json, f"node {node} uncordoned: it takes work again")


@node_app.command("drain")
def drain(node: str, reason: Reason = "drained by an operator", data_dir: DataDir = None,
          as_json: JsonOut = False) -> None:
    """Cordon NODE and move what runs there (`kubectl drain`): each job is stopped (SIGTERM, its
    grace: a checkpointing job saves) and runs again elsewhere from its last checkpoint, without
    spending a retry. `gpufleet node uncordon` when the node is back."""
    from gpufleet.shared.contract.events import NodeCordoned

    _state(NodeCordoned(node_id=node, reason=reason, drain=True), data_dir, as_json,
           f"node {node} drained: no new work, its jobs move (`gpufleet explain JOB` shows each)")


@gpu_app.command("return")
def gpu_return(node: str, gpu: Annotated[int, typer.Argument(min=0, help="the GPU's index on the node")],
               reason: Reason = "returned to service by an operator", data_dir: DataDir = None,
               as_json: JsonOut = False) -> None:
    """GPU of NODE back into service after an unhealthy report or a quarantine (zombie memory,
    left unclean): every hold on it is lifted. Telemetry reports it again if it fails again."""
    from gpufleet.shared.contract.events import NodeGpuCleared

    _state(NodeGpuCleared(node_id=node, gpu_index=gpu, reason=reason, returned=True), data_dir, as_json,
           f"GPU {gpu} of {node} returned to service")


@job_app.command("requeue")
def requeue(job: str, reason: Reason = "requeued by an operator", data_dir: DataDir = None,
            as_json: JsonOut = False) -> None:
    """Stop JOB (placed or running) and place it again, from its last checkpoint, spending no retry."""
    env = _run(_with_fleet(data_dir, lambda f: f.requeue(job, reason)))
    _said(env, as_json, f"job {job} requeued: attempt {env.payload.attempt} will be placed")
