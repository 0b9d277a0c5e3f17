// Command submit_and_follow submits a job to gpufleet and follows its events to the end.
//
// Written from docs/clients.md, docs/schemas/, README.md and docs/security.md only: it uses
// nothing of gpufleet, only the Go standard library, nats.go and nkeys.
//
//	submit_and_follow URL SPEC_JSON --creds FILE [--timeout-s 120] [--job-id ID] [--verdict]
//	                  [--bad-envelope no-actor|tenant-mismatch|no-msg-id|msg-id-mismatch|
//	                                  event-id-not-ulid|extra-field|bad-json]
//
// stdout: one JSON object per line (the submit's ack, each event of the job in log order, the
// verdict if asked for, and last the end). Exit status: 0 job.succeeded; 1 the job ended
// otherwise (or its submit was refused); 2 the client could not do its part; 3 no end in time.
package main

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

const (
	actor  = "gpufleet-go-client/1.0"
	stream = "FLEET"
)

// ---------------------------------------------------------------- ULIDs (docs/clients.md, section 2)

const crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

// newULID: 48-bit milliseconds then 80 random bits, as 26 characters of Crockford base32
// (10 for the time, so the first is 0-7, and 16 for the randomness).
func newULID() string {
	var b [16]byte
	ms := uint64(time.Now().UnixMilli())
	for i := 0; i < 6; i++ {
		b[i] = byte(ms >> (8 * (5 - i)))
	}
	if _, err := rand.Read(b[6:]); err != nil {
		panic(err)
	}
	// 128 bits as 26 groups of 5 bits, the first group holding the top 3 bits only (130 bits).
	out := make([]byte, 26)
	var hi, lo uint64
	for i := 0; i < 8; i++ {
		hi = hi<<8 | uint64(b[i])
		lo = lo<<8 | uint64(b[8+i])
	}
	for i := 25; i >= 0; i-- {
		out[i] = crockford[lo&31]
		lo = lo>>5 | hi<<59
		hi >>= 5
	}
	return string(out)
}

// ---------------------------------------------------------------- output

var stdoutMu sync.Mutex

func emit(v interface{}) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		fail("cannot encode output: %v", err)
	}
	stdoutMu.Lock()
	defer stdoutMu.Unlock()
	os.Stdout.Write(buf.Bytes())
}

// fail: the client could not do its part (usage, connection, credentials, permissions): exit 2.
func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "error: "+format+"\n", args...)
	os.Exit(2)
}

// ---------------------------------------------------------------- credentials (section 1)

type creds struct {
	Identity    string `json:"identity"`
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	Seed        string `json:"seed"`
	PublicKey   string `json:"public_key"`
	InboxPrefix string `json:"inbox_prefix"`
	// other keys of gpufleet's own (gpufleet_creds, services, snapshot_keys) are ignored
}

func readCreds(path string) creds {
	raw, err := os.ReadFile(path)
	if err != nil {
		fail("cannot read credentials: %v", err)
	}
	var c creds
	if err := json.Unmarshal(raw, &c); err != nil {
		fail("credentials %s are not JSON: %v", path, err)
	}
	if c.Seed == "" || c.Name == "" || c.InboxPrefix == "" {
		fail("credentials %s lack seed, name or inbox_prefix", path)
	}
	return c
}

// ---------------------------------------------------------------- the command

type options struct {
	url, specJSON, credsPath, jobID, badEnvelope string
	timeout                                      time.Duration
	verdict                                      bool
}

var badKinds = map[string]bool{"no-actor": true, "tenant-mismatch": true, "no-msg-id": true,
	"msg-id-mismatch": true, "event-id-not-ulid": true, "extra-field": true, "bad-json": true}

func parseArgs() options {
	fs := flag.NewFlagSet("submit_and_follow", flag.ContinueOnError)
	var o options
	var timeoutS float64
	fs.StringVar(&o.credsPath, "creds", os.Getenv("GPUFLEET_CREDS"), "a tenant's credentials file (gpufleet tenant creds NAME)")
	fs.Float64Var(&timeoutS, "timeout-s", 120, "give up (exit 3) when the job has not ended after this many seconds")
	fs.StringVar(&o.jobID, "job-id", "", "the job id (default: a new ULID)")
	fs.BoolVar(&o.verdict, "verdict", false, "also ask admission for its verdict by request/reply (Gpufleet-Reply)")
	fs.StringVar(&o.badEnvelope, "bad-envelope", "", "publish a deliberately broken envelope: "+
		"no-actor|tenant-mismatch|no-msg-id|msg-id-mismatch|event-id-not-ulid|extra-field|bad-json")
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: submit_and_follow URL SPEC_JSON --creds FILE [--timeout-s S] [--job-id ID] [--verdict] [--bad-envelope KIND]")
		fs.PrintDefaults()
	}
	// flags may come before, between or after the two positional arguments
	var pos []string
	args := os.Args[1:]
	for {
		if err := fs.Parse(args); err != nil {
			os.Exit(2)
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) != 2 {
		fs.Usage()
		os.Exit(2)
	}
	o.url, o.specJSON = pos[0], pos[1]
	if o.credsPath == "" {
		fail("--creds is required: nothing connects to gpufleet without credentials")
	}
	if o.badEnvelope != "" && !badKinds[o.badEnvelope] {
		fail("unknown --bad-envelope %q", o.badEnvelope)
	}
	if timeoutS <= 0 {
		fail("--timeout-s must be positive")
	}
	o.timeout = time.Duration(timeoutS * float64(time.Second))
	return o
}

// ackSeq: the stream sequence of a pushed message, from its reply subject (section 3):
// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>,
// or the newer form with a domain and an account hash after ACK (12 tokens or more).
func ackSeq(reply string) interface{} {
	t := strings.Split(reply, ".")
	var s string
	switch {
	case len(t) == 9 && t[0] == "$JS" && t[1] == "ACK":
		s = t[5]
	case len(t) >= 12 && t[0] == "$JS" && t[1] == "ACK":
		s = t[7]
	default:
		return nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return nil
	}
	return n
}

// reasonsOf: the reasons an ending event carries (`reasons`, or job.failed's single `reason`).
func reasonsOf(payload map[string]json.RawMessage) []json.RawMessage {
	var rs []json.RawMessage
	if raw, ok := payload["reasons"]; ok && json.Unmarshal(raw, &rs) == nil && rs != nil {
		return rs
	}
	if raw, ok := payload["reason"]; ok && len(raw) > 0 && raw[0] == '{' {
		return []json.RawMessage{raw}
	}
	return []json.RawMessage{}
}

var terminal = map[string]bool{"job.succeeded": true, "job.failed": true, "job.cancelled": true, "job.rejected": true}

func main() {
	o := parseArgs()
	c := readCreds(o.credsPath)
	tenant := c.Name

	var spec map[string]interface{}
	dec := json.NewDecoder(strings.NewReader(o.specJSON))
	dec.UseNumber() // the spec goes out as written: 0.25 stays 0.25, 8 stays 8
	if err := dec.Decode(&spec); err != nil || spec == nil {
		fail("the spec is not a JSON object: %v", err)
	}
	if _, ok := spec["tenant"]; !ok {
		spec["tenant"] = tenant
	}
	jobID := o.jobID
	if jobID == "" {
		jobID = newULID()
	}

	// ---- connect (section 1): the nkey seed, and every reply subject under inbox_prefix
	kp, err := nkeys.FromSeed([]byte(c.Seed))
	if err != nil {
		fail("credentials: bad seed: %v", err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		fail("credentials: %v", err)
	}
	var asyncMu sync.Mutex
	var asyncErrs []string
	nc, err := nats.Connect(o.url,
		nats.Name(actor),
		nats.Nkey(pub, kp.Sign),
		nats.CustomInboxPrefix(c.InboxPrefix),
		nats.Timeout(10*time.Second),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			asyncMu.Lock()
			asyncErrs = append(asyncErrs, err.Error())
			asyncMu.Unlock()
			fmt.Fprintf(os.Stderr, "nats: %v\n", err)
		}),
	)
	if err != nil {
		fail("cannot connect to %s: %v", o.url, err)
	}
	defer nc.Close()
	failWithAsync := func(format string, args ...interface{}) {
		asyncMu.Lock()
		extra := strings.Join(asyncErrs, "; ")
		asyncMu.Unlock()
		if extra != "" {
			format += " (" + extra + ")"
		}
		fail(format, args...)
	}
	deadline := time.Now().Add(o.timeout)

	// ---- follow first, then submit (section 3): a push consumer created on the API subject
	// that carries its filter, delivering into our own inbox
	deliver := nc.NewInbox()
	events := make(chan *nats.Msg, 1024)
	if _, err := nc.ChanSubscribe(deliver, events); err != nil {
		fail("cannot subscribe to %s: %v", deliver, err)
	}
	filter := fmt.Sprintf("fleet.evt.%s.job.%s.>", tenant, jobID)
	consumer := newULID()
	create, _ := json.Marshal(map[string]interface{}{
		"stream_name": stream,
		"config": map[string]interface{}{
			"name": consumer, "filter_subject": filter, "deliver_subject": deliver,
			"ack_policy": "none", "deliver_policy": "all",
			"inactive_threshold": int64(60 * time.Second), "mem_storage": true,
		},
	})
	resp, err := nc.Request(fmt.Sprintf("$JS.API.CONSUMER.CREATE.%s.%s.%s", stream, consumer, filter), create, 10*time.Second)
	if err != nil {
		failWithAsync("cannot create the consumer: %v", err)
	}
	var created struct {
		Error *struct {
			Code        int    `json:"code"`
			ErrCode     int    `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &created); err != nil {
		fail("consumer create answered %q: %v", resp.Data, err)
	}
	if created.Error != nil {
		fail("consumer create refused: %d %d %s", created.Error.Code, created.Error.ErrCode, created.Error.Description)
	}

	// ---- the verdict (section 2, request/reply): subscribe to our inbox before publishing
	var verdicts chan *nats.Msg
	var replyTo string
	if o.verdict {
		replyTo = nc.NewInbox()
		verdicts = make(chan *nats.Msg, 4)
		if _, err := nc.ChanSubscribe(replyTo, verdicts); err != nil {
			fail("cannot subscribe to %s: %v", replyTo, err)
		}
	}
	if err := nc.Flush(); err != nil {
		failWithAsync("flush: %v", err)
	}

	// ---- submit (section 2): one envelope on fleet.cmd.<tenant>.submit, through JetStream
	eventID := newULID()
	env := map[string]interface{}{
		"event_id":       eventID,
		"type":           "cmd.submit",
		"schema_version": 1,
		"occurred_at":    time.Now().UTC().Format(time.RFC3339Nano),
		"tenant":         tenant,
		"actor":          actor,
		"correlation_id": jobID,
		"payload":        map[string]interface{}{"type": "cmd.submit", "job_id": jobID, "spec": spec},
	}
	msgID := eventID
	switch o.badEnvelope {
	case "no-actor":
		delete(env, "actor")
	case "tenant-mismatch":
		env["tenant"] = "not-" + tenant // the subject still names our tenant
	case "msg-id-mismatch":
		msgID = newULID()
	case "no-msg-id":
		msgID = ""
	case "event-id-not-ulid":
		eventID = "not-a-ulid-" + jobID
		env["event_id"] = eventID
		msgID = eventID
	case "extra-field":
		env["colour"] = "blue"
	}
	data, err := json.Marshal(env)
	if err != nil {
		fail("cannot encode the envelope: %v", err)
	}
	if o.badEnvelope == "bad-json" {
		data = data[:len(data)/2] // cut in half: not JSON, so no job id can be read from it
	}
	msg := nats.NewMsg(fmt.Sprintf("fleet.cmd.%s.submit", tenant))
	msg.Data = data
	if msgID != "" {
		msg.Header.Set("Nats-Msg-Id", msgID)
	}
	if replyTo != "" {
		msg.Header.Set("Gpufleet-Reply", replyTo)
	}
	js, err := nc.JetStream()
	if err != nil {
		fail("jetstream: %v", err)
	}
	ack, err := js.PublishMsg(msg, nats.AckWait(10*time.Second))
	if err != nil {
		failWithAsync("the submit was not acknowledged: %v", err)
	}
	emit(map[string]interface{}{"submitted": jobID, "seq": ack.Sequence, "stream": ack.Stream,
		"duplicate": ack.Duplicate, "event_id": eventID})

	// ---- what comes back (sections 4 and 5), until the job ends
	var end map[string]interface{}
	code := 3
	gotVerdict := !o.verdict
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for end == nil {
		select {
		case m := <-events:
			var ev struct {
				Type    string                     `json:"type"`
				Payload map[string]json.RawMessage `json:"payload"`
			}
			if err := json.Unmarshal(m.Data, &ev); err != nil {
				fmt.Fprintf(os.Stderr, "warning: an event that is not JSON on %s: %v\n", m.Subject, err)
				continue
			}
			emit(map[string]interface{}{"seq": ackSeq(m.Reply), "subject": m.Subject, "type": ev.Type,
				"event": json.RawMessage(m.Data)})
			ours := false
			if ev.Type == "job.request_refused" { // about one command: ours, if it names our event_id
				var cmdID string
				_ = json.Unmarshal(ev.Payload["command_id"], &cmdID)
				ours = cmdID == eventID
			}
			if terminal[ev.Type] || ours {
				end = map[string]interface{}{"done": ev.Type, "job_id": jobID, "reasons": reasonsOf(ev.Payload)}
				if ev.Type == "job.succeeded" {
					code = 0
				} else {
					code = 1
				}
			}
		case m := <-verdicts:
			gotVerdict = true
			var v struct {
				Accepted bool              `json:"accepted"`
				Events   []json.RawMessage `json:"events"`
			}
			if err := json.Unmarshal(m.Data, &v); err != nil {
				fmt.Fprintf(os.Stderr, "warning: a verdict that is not JSON: %v\n", err)
				continue
			}
			emit(map[string]interface{}{"verdict": json.RawMessage(m.Data)})
			if !v.Accepted && len(v.Events) == 0 { // no readable job id: nothing will come on the job
				end = map[string]interface{}{"done": nil, "job_id": jobID, "refused": true, "reasons": []interface{}{}}
				code = 1
			}
		case <-timer.C:
			end = map[string]interface{}{"done": nil, "job_id": jobID, "timeout": true}
			code = 3
		}
	}
	// the verdict is best effort: wait a little for one asked for, but the job's end stands
	if !gotVerdict && code != 3 {
		wait := time.Until(deadline)
		if wait > 10*time.Second {
			wait = 10 * time.Second
		}
		select {
		case m := <-verdicts:
			emit(map[string]interface{}{"verdict": json.RawMessage(m.Data)})
		case <-time.After(wait):
			fmt.Fprintln(os.Stderr, "warning: no verdict came (best effort); the job's events say what happened")
		}
	}
	emit(end)
	nc.Close()
	os.Exit(code)
}
