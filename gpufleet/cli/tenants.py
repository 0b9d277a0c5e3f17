"""`tenant add | creds | list`: tenants' identities."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.cli.common import (
    DataDir,
    JsonOut,
    T,
    _print_json,
    app,
)
from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.errors import GpufleetError

tenant_app = typer.Typer(no_args_is_help=True, help="Tenants' identities: credentials to submit and watch as a tenant.")
app.add_typer(tenant_app, name="tenant")


def _realm_and_reload(data_dir: str | None, change: Callable[[Any], T]) -> tuple[T, bool]:
    """Apply `change` to the data dir's realm, rewrite nats.conf's authorization and, when the mesh
    runs, have nats-server reload it (SIGHUP). Returns change's result and whether it reloaded."""
    import signal

    from gpufleet.mesh import running_supervisor
    from gpufleet.shared.trust.authz import NATS_CONF, Realm, write_nats_config

    ddir = resolve_data_dir(data_dir)
    realm = Realm.load(ddir)
    if not realm.exists():
        raise GpufleetError(f"no identities in {ddir}: start the mesh there first (`gpufleet up`)")
    out = change(realm)
    conf_path = ddir / NATS_CONF
    reloaded = False
    if conf_path.exists():
        conf = json.loads(conf_path.read_text())
        conf["authorization"] = realm.authorization()
        write_nats_config(conf_path, conf)
        doc = running_supervisor(ddir)
        pid = ((doc or {}).get("parts", {}).get("nats") or {}).get("pid")
        if pid:
            os.kill(int(pid), signal.SIGHUP)
            reloaded = True
    return out, reloaded


@tenant_app.command("add")
def tenant_add(name: str, data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """Create a tenant's identity (an nkey; its credentials file is mode 0600) and let the server admit it."""
    from gpufleet.shared.trust.authz import Realm

    def add(realm: Realm) -> Path:
        try:
            realm.add("tenant", name)
        except ValueError as exc:
            raise GpufleetError(str(exc)) from None
        return realm.creds_path(f"tenant-{name}")

    try:
        path, reloaded = _realm_and_reload(data_dir, add)
    except GpufleetError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        _print_json({"tenant": name, "creds": str(path), "reloaded": reloaded})
        return
    typer.echo(f"tenant {name}: credentials in {path}" + ("" if reloaded else " (the mesh is not running: "
                                                             "its next start admits them)"))
    typer.echo(f"  give that file to {name}; they run e.g.  gpufleet --creds {name}.creds submit job.yaml")


@tenant_app.command("creds")
def tenant_creds(name: str, data_dir: DataDir = None,
                 output: Annotated[Path | None, typer.Option("--output", "-o", help="copy the credentials here (mode 0600)")] = None,
                 ) -> None:
    """Where a tenant's credentials are (or a copy of them, with -o)."""
    from gpufleet.shared.contract.config import write_private
    from gpufleet.shared.trust.authz import Realm

    realm = Realm.load(resolve_data_dir(data_dir))
    path = realm.creds_path(f"tenant-{name}")
    if not path.exists():
        known = ", ".join(realm.tenants()) or "none"
        typer.echo(f"error: no tenant {name!r} (known: {known}); create it with `gpufleet tenant add {name}`", err=True)
        raise typer.Exit(1)
    if output is not None:
        write_private(output, path.read_text())
        typer.echo(str(output))
        return
    typer.echo(str(path))


@tenant_app.command("list")
def tenant_list(data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """The tenants that have credentials."""
    from gpufleet.shared.trust.authz import Realm

    names = Realm.load(resolve_data_dir(data_dir)).tenants()
    if as_json:
        _print_json(names)
        return
    for n in names:
        typer.echo(n)


