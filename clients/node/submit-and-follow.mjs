// A gpufleet client written in JavaScript, with only the `nats` package from npm: it submits a
// job by publishing a `cmd.submit` envelope (docs/schemas/cmd.submit.schema.json) to JetStream
// and follows the job's events on `fleet.evt.<tenant>.job.<id>.>` until the job ends.
//
//   node submit-and-follow.mjs NATS_URL SPEC_JSON [--creds FILE] [--timeout-s 60]
//
// FILE (or $GPUFLEET_CREDS) is the tenant's credentials file from `gpufleet tenant creds NAME`:
// JSON with an nkey `seed` and the `inbox_prefix` its replies must use (docs/security.md). A
// tenant may read only its own subjects, through a consumer whose create subject carries the
// filter: the ordered consumer below is one.
//
// Prints one JSON line per event ({"seq", "type", "job_id", ...}); the last line is
// {"done": "<final type>", "job_id": ...}. Exit code 0 when the job succeeded, 1 when it ended
// otherwise, 2 on a usage or connection error, 3 on timeout.
import { connect, consumerOpts, headers, JSONCodec, nkeyAuthenticator } from "nats";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";

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
const opt = (name) => (rest.indexOf(name) >= 0 ? rest[rest.indexOf(name) + 1] : undefined);
const timeoutS = Number(opt("--timeout-s") || 60);
const credsPath = opt("--creds") || process.env.GPUFLEET_CREDS;
let creds = null;
if (credsPath) {
  try {
    creds = JSON.parse(readFileSync(credsPath, "utf8"));
  } catch (err) {
    console.error(`cannot read credentials ${credsPath}: ${err.message}`);
    process.exit(2);
  }
}
const spec = JSON.parse(specJson);
if (creds && creds.kind === "tenant" && spec.tenant === undefined) spec.tenant = creds.name;
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
  const auth = creds
    ? { authenticator: nkeyAuthenticator(new TextEncoder().encode(creds.seed)), inboxPrefix: creds.inbox_prefix }
    : {};
  nc = await connect({ servers: url, name: "gpufleet-node-client", maxReconnectAttempts: 2, ...auth });
} catch (err) {
  console.error(`cannot connect to ${url}: ${err.message}`);
  process.exit(2);
}
const js = nc.jetstream();

// Follow first (from the start of the job's subject), then submit: nothing can be missed.
// A push consumer filtered to the job's subjects, created on the API subject that carries the
// filter (`$JS.API.CONSUMER.CREATE.FLEET.<name>.<filter>`): the one shape a tenant is allowed.
const inbox = `${nc.options.inboxPrefix || "_INBOX"}.${jobId}`;
const sub = nc.subscribe(inbox);
const jsm = await nc.jetstreamManager();
await jsm.consumers.add("FLEET", {
  name: `follow-${jobId}`, filter_subject: `fleet.evt.${tenant}.job.${jobId}.>`, deliver_subject: inbox,
  ack_policy: "none", deliver_policy: "all", inactive_threshold: 60_000_000_000, mem_storage: true,
});
// the stream sequence of a delivered message: $JS.ACK.<stream>.<consumer>.<delivered>.<seq>.…
const streamSeq = (m) => Number((m.reply || "").split(".")[5]);

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
  console.log(JSON.stringify({ seq: streamSeq(m), type: ev.type, job_id: ev.payload.job_id, actor: ev.actor,
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
