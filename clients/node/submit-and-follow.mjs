// A gpufleet client written in JavaScript, with only the `nats` package from npm: it submits a
// job by publishing a `cmd.submit` envelope (docs/schemas/cmd.submit.schema.json) to JetStream
// and follows the job's events on `fleet.evt.<tenant>.job.<id>.>` until the job ends.
//
//   node submit-and-follow.mjs NATS_URL SPEC_JSON [--timeout-s 60]
//
// Prints one JSON line per event ({"seq", "type", "job_id", ...}); the last line is
// {"done": "<final type>", "job_id": ...}. Exit code 0 when the job succeeded, 1 when it ended
// otherwise, 2 on a usage or connection error, 3 on timeout.
import { connect, consumerOpts, headers, JSONCodec } from "nats";
import { randomBytes } from "node:crypto";

const TERMINAL = new Set(["job.succeeded", "job.failed", "job.cancelled", "job.rejected"]);
const CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";

// A ULID (26 chars: 48-bit time in ms, 80 random bits, Crockford base32): the envelope's event_id.
function ulid(ms = Date.now()) {
  let time = "";
  for (let i = 0, t = ms; i < 10; i++, t = Math.floor(t / 32)) time = CROCKFORD[t % 32] + time;
  const rnd = randomBytes(16);
  let rand = "";
  for (let i = 0; i < 16; i++) rand += CROCKFORD[rnd[i] % 32];
  return time + rand;
}

const [url, specJson, ...rest] = process.argv.slice(2);
if (!url || !specJson) {
  console.error("usage: node submit-and-follow.mjs NATS_URL SPEC_JSON [--timeout-s 60]");
  process.exit(2);
}
const timeoutS = Number(rest[rest.indexOf("--timeout-s") + 1] || 60);
const spec = JSON.parse(specJson);
const tenant = spec.tenant;
const jobId = ulid();
const envelope = {
  event_id: ulid(),
  type: "cmd.submit",
  schema_version: 1,
  occurred_at: new Date().toISOString(),
  tenant,
  actor: "node-client",
  correlation_id: jobId,
  payload: { type: "cmd.submit", job_id: jobId, spec },
};

const jc = JSONCodec();
let nc;
try {
  nc = await connect({ servers: url, name: "gpufleet-node-client" });
} catch (err) {
  console.error(`cannot connect to ${url}: ${err.message}`);
  process.exit(2);
}
const js = nc.jetstream();

// Follow first (from the start of the job's subject), then submit: nothing can be missed.
const opts = consumerOpts();
opts.orderedConsumer();
opts.deliverAll();
const sub = await js.subscribe(`fleet.evt.${tenant}.job.${jobId}.>`, opts);

const h = headers();
h.set("Nats-Msg-Id", envelope.event_id); // the server drops a re-sent copy
const ack = await js.publish(`fleet.cmd.${tenant}.submit`, jc.encode(envelope), { headers: h });
console.log(JSON.stringify({ submitted: jobId, stream: ack.stream, seq: ack.seq }));

const timer = setTimeout(async () => {
  console.log(JSON.stringify({ done: "timeout", job_id: jobId }));
  await nc.close();
  process.exit(3);
}, timeoutS * 1000);

let final = null;
for await (const m of sub) {
  const ev = jc.decode(m.data);
  console.log(JSON.stringify({ seq: m.seq, type: ev.type, job_id: ev.payload.job_id, actor: ev.actor,
                               at: ev.occurred_at }));
  if (TERMINAL.has(ev.type)) {
    final = ev.type;
    break;
  }
}
clearTimeout(timer);
console.log(JSON.stringify({ done: final, job_id: jobId }));
await nc.close();
process.exit(final === "job.succeeded" ? 0 : 1);
