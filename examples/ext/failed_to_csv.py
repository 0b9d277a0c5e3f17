"""Append every failed job, with its reason, to a CSV: a 20-line subscriber on gpufleet's events.

    pip install 'gpufleet[ext]'
    faststream run examples.ext.failed_to_csv:app     # against the mesh of ~/.gpufleet
"""

import csv
import os

from faststream import FastStream

from gpufleet.ext import FleetRouter, fleet_broker
from gpufleet.shared.contract.events import Envelope

OUT = os.environ.get("FAILED_CSV", "failed-jobs.csv")
fleet = FleetRouter()


@fleet.subscriber("job.failed", durable="failed-to-csv")
def failed(env: Envelope) -> None:  # (FastStream runs a plain function in a worker thread)
    with open(OUT, "a", newline="") as f:
        csv.writer(f).writerow([env.occurred_at.isoformat(), env.tenant, env.job_id,
                                env.payload.reason.code, env.payload.reason.message])  # type: ignore[union-attr]


broker = fleet_broker()
broker.include_router(fleet)
app = FastStream(broker)
