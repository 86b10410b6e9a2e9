#!/usr/bin/env python3
"""Soak: mixed traffic from many clients against two `picaso serve` processes sharing one store
on PostgreSQL + S3, while faults are injected, then a check that nothing acknowledged was lost.

    scripts/soak.sh                      # sets up the services and runs this (30 minutes)
    python3 scripts/soak.py --help       # the knobs

What runs:
  * PostgreSQL (the CI one, `.ci/services start`) and s3rver (an S3 API that keeps its objects
    on disk, so restarting it loses nothing, like a real S3 endpoint: moto keeps them in memory);
  * two servers, A and B, on the same `--db postgres://...` and `--states s3://...`;
  * N client threads, each looping over: add a context (POST /v1/contexts), complete with
    retrieval (POST /v1/completions, retrieve=2), complete from its own contexts, stream a
    completion and hang up after the first chunk, stream one to the end, search, read a context
    back, delete one of its own contexts. Each request goes to A or B at random.
  * faults, one at a time, in a cycle: PostgreSQL stopped for 10 s then started; the S3 server
    killed for 10 s then started; server A SIGKILLed then restarted 5 s later; same for B.

What is checked (and written to OUT/soak.json, OUT/soak.md, OUT/soak.png):
  * every answer is well formed: JSON with the documented shape (a completion's choices, an
    added context's id, `{"error": {"message", "type"}}` for every error), SSE streams whose
    events are JSON and end with [DONE] when read to the end;
  * errors: 503 only while a fault is on (or within GRACE seconds after it ends); connection
    errors, and streams cut off before [DONE], only from a server that is down (SIGKILLed); no 500, no other 5xx, no 4xx (the traffic is valid);
  * no acknowledged write lost: after the run, every context whose add was answered 200/201 and
    that was never deleted is read back from both servers with the same text, and its state
    loads (completions over all of them, 64 per request); every acknowledged delete stays deleted;
  * memory: each server's RSS every second; the requests in flight drop back to 0.
"""

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

WORDS = (
    "river mountain castle engine library harbor garden bridge museum station forest village "
    "island railway canal tower market temple valley desert glacier comet violin harvest "
    "lantern copper marble falcon orchard meadow summit quarry beacon furnace chapel ferry "
    "granite saddle compass anchor parchment telescope cathedral monastery aqueduct citadel"
).split()


# Outcomes a killed server explains: a refused connection, a stream cut off mid-way.
SERVER_KILLED = ("conn_refused_server_down", "stream_cut_server_killed")
EXPECTED = ("ok", "503_during_fault") + SERVER_KILLED


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


class Service:
    """A process we can kill and start again (a server, the S3 endpoint)."""

    def __init__(self, name, argv, env, logfile, ready):
        self.name, self.argv, self.env, self.logfile, self.ready = name, argv, env, logfile, ready
        self.proc = None

    def start(self):
        out = open(self.logfile, "a")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        while not self.ready():
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited at start (see {self.logfile})")
            if time.time() - t0 > 120:
                raise SystemExit(f"{self.name} not ready after 120 s (see {self.logfile})")
            time.sleep(0.1)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait()

    def rss_mib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            return None
        return None


def port_answers(host, port, path="/"):
    try:
        c = http.client.HTTPConnection(host, port, timeout=2)
        c.request("GET", path)
        c.getresponse().read()
        return True
    except OSError:
        return False


class Ledger:
    """What the clients were told: contexts acknowledged, deleted, or of unknown fate."""

    def __init__(self):
        self.lock = threading.Lock()
        self.present = {}  # id -> text: acknowledged add, no delete tried
        self.deleted = set()  # acknowledged delete
        self.unknown = {}  # id -> text: a delete that failed or was cut off (either fate is fine)
        self.adds_unacked = 0  # adds that failed or were cut off (either fate is fine)


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.rows = []  # (t, op, server, status, latency_s, outcome, detail)

    def add(self, *row):
        with self.lock:
            self.rows.append(row)


def request(port, method, path, body=None, timeout=120):
    """(status, parsed JSON or None, raw text). Raises OSError on connection trouble."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        raw = r.read().decode("utf-8", "replace")
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        return r.status, parsed, raw
    finally:
        c.close()


def well_formed_error(v):
    return (isinstance(v, dict) and isinstance(v.get("error"), dict)
            and isinstance(v["error"].get("message"), str) and isinstance(v["error"].get("type"), str))


def well_formed_completion(v):
    try:
        return v["object"] == "text_completion" and isinstance(v["choices"][0]["text"], str)
    except (KeyError, IndexError, TypeError):
        return False


def stream(port, body, hang_up):
    """Streams a completion: (status, outcome) where outcome is 'ok', 'hung_up' or a defect."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raw = r.read().decode("utf-8", "replace")
            try:
                ok = well_formed_error(json.loads(raw))
            except ValueError:
                ok = False
            return r.status, "error" if ok else f"malformed error body: {raw[:200]!r}"
        done = False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode("utf-8", "replace").strip()
            if not line or line.startswith(":"):
                continue
            if not line.startswith("data: "):
                return 200, f"malformed SSE line: {line[:200]!r}"
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            try:
                event = json.loads(payload)
            except ValueError:
                return 200, f"malformed SSE event: {payload[:200]!r}"
            if "error" in event:
                return 200, "error_in_stream" if well_formed_error(event) else f"malformed error event: {payload[:200]!r}"
            if not well_formed_completion(event):
                return 200, f"malformed chunk: {payload[:200]!r}"
            if hang_up:
                return 200, "hung_up"  # closing the connection below is the hang-up
        return 200, "ok" if done else "stream ended without [DONE]"
    finally:
        c.close()


class Soak:
    def __init__(self, args, ports, servers, faults_on):
        self.args, self.ports, self.servers = args, ports, servers
        self.faults_on = faults_on  # callable(t) -> (fault name or None, server name down or None)
        self.ledger, self.rec = Ledger(), Recorder()
        self.stop = threading.Event()
        self.t0 = time.time()

    def text(self, rng, client, n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(25, 60)))
        return f"Soak record {client}-{n}. The {rng.choice(WORDS)} of {rng.choice(WORDS)} has a {words}."

    def client(self, cid):
        rng = random.Random(1000 + cid)
        mine = []  # ids this client added and may delete
        n = 0
        ops = ["add", "complete_retrieve", "complete_ids", "stream_hangup", "stream_full", "search", "get", "delete",
               "chat_template", "template_bomb"]
        weights = [25, 15, 10, 10, 5, 15, 10, 10, 3, 2]
        while not self.stop.is_set():
            op = rng.choices(ops, weights)[0]
            if op in ("complete_ids", "get", "delete") and not mine:
                op = "add"
            server = rng.choice(list(self.ports))
            port = self.ports[server]
            t = time.time() - self.t0
            t1 = time.perf_counter()
            status, outcome, detail = None, None, ""
            try:
                if op == "add":
                    n += 1
                    text = self.text(rng, cid, n)
                    status, v, raw = request(port, "POST", "/v1/contexts",
                                             {"text": text, "doc": f"soak/{cid}/{n}"})
                    if status in (200, 201) and isinstance(v, dict) and isinstance(v.get("id"), int):
                        with self.ledger.lock:
                            self.ledger.present[v["id"]] = text
                        mine.append(v["id"])
                        outcome = "ok"
                    else:
                        with self.ledger.lock:
                            self.ledger.adds_unacked += 1
                        outcome, detail = self.judge_error(status, v, raw)
                elif op in ("complete_retrieve", "complete_ids"):
                    body = {"prompt": f"The {rng.choice(WORDS)} of", "max_tokens": self.args.max_tokens,
                            "temperature": 0.7, "seed": rng.randrange(1 << 30)}
                    if op == "complete_retrieve":
                        body["retrieve"] = 2
                    else:
                        body["contexts"] = rng.sample(mine, min(len(mine), 3))
                        body["composition"] = rng.choice(["picaso-r", "picaso-s", "caso", "soup"])
                    status, v, raw = request(port, "POST", "/v1/completions", body)
                    if status == 200 and well_formed_completion(v):
                        outcome = "ok"
                    elif status == 404 and op == "complete_ids" and well_formed_error(v):
                        # one of this client's contexts whose delete was cut off and yet done
                        outcome = "ok" if self.any_unknown(body["contexts"]) else "lost"
                        detail = raw[:200]
                    else:
                        outcome, detail = self.judge_error(status, v, raw)
                elif op in ("stream_hangup", "stream_full"):
                    body = {"prompt": f"A {rng.choice(WORDS)} is", "max_tokens": self.args.max_tokens,
                            "temperature": 0.7, "stream": True, "retrieve": 1}
                    status, result = stream(port, body, hang_up=(op == "stream_hangup"))
                    if result in ("ok", "hung_up"):
                        outcome = "ok"
                    elif result in ("error", "error_in_stream"):
                        outcome = "503" if status == 503 or result == "error_in_stream" else f"http_{status}"
                        outcome = self.expected(outcome)
                    elif result == "stream ended without [DONE]" and self.faults_on(time.time() - self.t0)[1] == server:
                        # a SIGKILLed server cannot finish its streams: the connection just closes
                        outcome, detail = "stream_cut_server_killed", result
                    else:
                        outcome, detail = "malformed", result
                elif op in ("chat_template", "template_bomb"):
                    # A chat with the request's own template (the servers run with
                    # --trust-request-chat-template): a plain one answers, a bomb is a 400.
                    bomb = rng.choice(BOMBS) if op == "template_bomb" else None
                    body = {"messages": [{"role": "user", "content": f"The {rng.choice(WORDS)} of"}],
                            "max_tokens": self.args.max_tokens, "chat_template": bomb["template"] if bomb else CHATML}
                    status, v, raw = request(port, "POST", "/v1/chat/completions", body)
                    if bomb is None and status == 200 and isinstance(v, dict) and v.get("choices"):
                        outcome = "ok"
                    elif bomb is not None and status == 400 and well_formed_error(v):
                        outcome, detail = "ok", bomb["name"]
                    else:
                        outcome, detail = self.judge_error(status, v, raw)
                elif op == "search":
                    status, v, raw = request(port, "POST", "/v1/search", {"query": rng.choice(WORDS), "k": 3})
                    if status == 200 and isinstance(v, dict) and isinstance(v.get("results"), list):
                        outcome = "ok"
                    else:
                        outcome, detail = self.judge_error(status, v, raw)
                elif op == "get":
                    cid_ = rng.choice(mine)
                    status, v, raw = request(port, "GET", f"/v1/contexts/{cid_}")
                    with self.ledger.lock:
                        want = self.ledger.present.get(cid_)
                    if status == 200 and isinstance(v, dict):
                        outcome = "ok" if want is None or v.get("text") == want else "wrong_text"
                    elif status == 404 and well_formed_error(v):
                        outcome = "ok" if want is None else "lost"
                    else:
                        outcome, detail = self.judge_error(status, v, raw)
                elif op == "delete":
                    cid_ = mine.pop(rng.randrange(len(mine)))
                    with self.ledger.lock:
                        text = self.ledger.present.pop(cid_, None)
                    try:
                        status, v, raw = request(port, "DELETE", f"/v1/contexts/{cid_}")
                    except OSError:
                        with self.ledger.lock:
                            self.ledger.unknown[cid_] = text
                        raise
                    if status == 200:
                        with self.ledger.lock:
                            self.ledger.deleted.add(cid_)
                        outcome = "ok"
                    else:
                        with self.ledger.lock:
                            self.ledger.unknown[cid_] = text
                        outcome, detail = self.judge_error(status, v, raw)
            except (OSError, http.client.HTTPException) as e:
                status = None
                fault, down = self.faults_on(time.time() - self.t0)
                outcome = "conn_refused_server_down" if down == server else "conn_error"
                detail = f"{type(e).__name__}: {e}"
            latency = time.perf_counter() - t1
            self.rec.add(round(t, 3), op, server, status, round(latency, 4), outcome, detail)

    def any_unknown(self, ids):
        with self.ledger.lock:
            return any(i in self.ledger.unknown or i in self.ledger.deleted for i in ids)

    def expected(self, outcome):
        """A 503 is expected during a fault (and GRACE seconds after it)."""
        if outcome == "503":
            fault, _ = self.faults_on(time.time() - self.t0)
            return "503_during_fault" if fault else "503_outside_fault"
        return outcome

    def judge_error(self, status, v, raw):
        if not well_formed_error(v):
            return "malformed", f"{status}: {raw[:200]!r}"
        if status == 503:
            return self.expected("503"), v["error"]["message"][:200]
        return f"http_{status}", v["error"]["message"][:200]


# Chat-template bombs (RELIABILITY.md, "Hostile templates"), and a plain template.
with open(os.path.join(os.path.dirname(__file__), "../crates/server/tests/fixtures/template_bombs.json")) as _f:
    BOMBS = json.load(_f)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    if sys.argv[1:2] == ["--render"]:
        # Rewrites OUT/soak.md from OUT/soak.json (after a change to the report's layout).
        out = sys.argv[2] if len(sys.argv) > 2 else "results/soak"
        with open(os.path.join(out, "soak.json")) as f:
            write_markdown(os.path.join(out, "soak.md"), json.load(f))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--picaso", default="target/release/picaso")
    ap.add_argument("--model", default="models/picaso-mamba2")
    ap.add_argument("--embedder", default="../shared/data/all-MiniLM-L6-v2")
    ap.add_argument("--postgres", required=True, help="postgres:// URL of an empty database (pgvector installed)")
    ap.add_argument("--pg-restart", required=True, nargs=2, metavar=("STOP_CMD", "START_CMD"),
                    help="shell commands that stop and start PostgreSQL")
    ap.add_argument("--s3rver", required=True, help="path of the s3rver executable (npm install s3rver)")
    ap.add_argument("--s3-port", type=int, default=54341)
    ap.add_argument("--run", required=True, help="scratch folder (logs, S3 data, the request log)")
    ap.add_argument("--out", default="results/soak")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--fault-every", type=float, default=150, help="seconds between faults")
    ap.add_argument("--outage", type=float, default=10, help="seconds PostgreSQL / S3 stay down")
    ap.add_argument("--grace", type=float, default=20, help="seconds after a fault in which 503s still count as expected")
    args = ap.parse_args()

    os.makedirs(args.run, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    bucket = "soak"
    prefix = time.strftime("run%Y%m%d%H%M%S")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER", AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{args.s3_port}", AWS_ALLOW_HTTP="true",
               PICASO_BACKEND_RETRY_MS="3000", PICASO_BACKEND_TIMEOUT_MS="5000")
    # A run writes about 8 GB of states; only the last run's objects are kept.
    shutil.rmtree(os.path.join(args.run, "s3-data"), ignore_errors=True)
    s3 = Service("s3rver", [args.s3rver, "-d", os.path.join(args.run, "s3-data"), "-a", "127.0.0.1", "-p",
                            str(args.s3_port), "--configure-bucket", bucket, "--silent"],
                 env, os.path.join(args.run, "s3rver.log"), lambda: port_answers("127.0.0.1", args.s3_port))
    s3.start()
    schema = prefix
    sep = "&" if "?" in args.postgres else "?"
    db = f"{args.postgres}{sep}options=-csearch_path%3D{schema}%2Cpublic"
    states = f"s3://{bucket}/{prefix}"

    # A small store to start from: 40 contexts through the CLI.
    docs = os.path.join(args.run, "docs")
    os.makedirs(docs, exist_ok=True)
    rng = random.Random(7)
    for i in range(40):
        with open(os.path.join(docs, f"seed{i:02}.txt"), "w") as f:
            f.write(f"Seed {i}. The {rng.choice(WORDS)} " + " ".join(rng.choice(WORDS) for _ in range(40)) + ".\n")
    subprocess.run([args.picaso, "ingest", "--db", db, "--states", states, "--model", args.model, "--embedder",
                    args.embedder, "--text-dir", docs], env=env, check=True, stdout=subprocess.DEVNULL)

    ports = {"A": 54351, "B": 54352}
    servers = {}
    for name, port in ports.items():
        argv = [args.picaso, "serve", "--db", db, "--model", args.model, "--embedder", args.embedder,
                "--addr", f"127.0.0.1:{port}", "--cache-mb", "64", "--trust-request-chat-template"]
        servers[name] = Service(f"server {name}", argv, env, os.path.join(args.run, f"server-{name}.log"),
                                lambda port=port: port_answers("127.0.0.1", port, "/v1/models"))
        servers[name].start()
    log(f"servers up: A :{ports['A']}, B :{ports['B']}; store {db} + {states}")

    # Fault schedule: (start, end-of-outage, name, server-down).
    faults = []
    lock = threading.Lock()

    def faults_on(t):
        with lock:
            for start, end, name, down in faults:
                if start <= t and (end is None or t <= end + args.grace):
                    return name, (down if end is None or t <= end + 2 else None)
        return None, None

    soak = Soak(args, ports, servers, faults_on)
    rss = []  # (t, server, MiB)

    def sample():
        while not soak.stop.is_set():
            t = time.time() - soak.t0
            for name, s in servers.items():
                m = s.rss_mib()
                if m is not None:
                    rss.append((round(t, 1), name, round(m, 1)))
            time.sleep(1)

    threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for th in threads:
        th.start()

    duration = args.minutes * 60
    kinds = ["postgres", "s3", "kill A", "kill B"]
    k = 0
    next_fault = min(120, duration / 4)
    while time.time() - soak.t0 < duration:
        t = time.time() - soak.t0
        if t < next_fault or next_fault > duration - 60:
            time.sleep(0.5)
            continue
        kind = kinds[k % len(kinds)]
        k += 1
        name = {"postgres": "PostgreSQL down", "s3": "S3 down", "kill A": "SIGKILL A", "kill B": "SIGKILL B"}[kind]
        down = {"kill A": "A", "kill B": "B"}.get(kind)
        with lock:
            faults.append([t, None, name, down])
        log(f"fault at {t:.0f} s: {name}")
        if kind == "postgres":
            subprocess.run(args.pg_restart[0], shell=True, check=True, stdout=subprocess.DEVNULL)
            time.sleep(args.outage)
            subprocess.run(args.pg_restart[1], shell=True, check=True, stdout=subprocess.DEVNULL)
        elif kind == "s3":
            s3.kill()
            time.sleep(args.outage)
            s3.start()
        else:
            servers[down].kill()
            time.sleep(5)
            servers[down].start()
        with lock:
            faults[-1][1] = time.time() - soak.t0
        log(f"fault over at {faults[-1][1]:.0f} s")
        next_fault = t + args.fault_every
    soak.stop.set()
    for th in threads:
        th.join(timeout=180)
    elapsed = time.time() - soak.t0
    log(f"traffic stopped after {elapsed:.0f} s; checking acknowledged writes")

    # In-flight gauges back to 0 (streams cut by clients included).
    time.sleep(3)
    in_flight = {}
    for name, port in ports.items():
        _, _, raw = request(port, "GET", "/metrics")
        for line in raw.splitlines():
            if line.startswith("picaso_requests_in_flight"):
                in_flight[name] = float(line.split()[-1]) - 1  # less the /metrics request itself

    # Acknowledged writes: read back from both servers; states load (completions, 64 ids each).
    ledger = soak.ledger
    lost, wrong, resurrected, half_written = [], [], [], []
    for name, port in ports.items():
        for cid, text in sorted(ledger.present.items()):
            status, v, _ = request(port, "GET", f"/v1/contexts/{cid}")
            if status != 200:
                lost.append((name, cid, status))
            elif v.get("text") != text:
                wrong.append((name, cid))
        for cid in sorted(ledger.deleted):
            status, _, _ = request(port, "GET", f"/v1/contexts/{cid}")
            if status != 404:
                resurrected.append((name, cid, status))
    unknown_present = [cid for cid in ledger.unknown
                       if request(ports["A"], "GET", f"/v1/contexts/{cid}")[0] == 200]
    loadable = sorted(ledger.present) + unknown_present

    def states_load(ids):
        status, v, raw = request(ports["A"], "POST", "/v1/completions",
                                 {"prompt": "The", "max_tokens": 1, "temperature": 0, "contexts": ids,
                                  "composition": "soup"}, timeout=600)
        if status == 200:
            return
        if len(ids) == 1:
            half_written.append((ids[0], status, raw[:200]))
            return
        states_load(ids[: len(ids) // 2])
        states_load(ids[len(ids) // 2:])

    for i in range(0, len(loadable), 64):
        states_load(loadable[i:i + 64])
    rss_end = {name: s.rss_mib() for name, s in servers.items()}
    panics = {}
    for name in servers:
        with open(os.path.join(args.run, f"server-{name}.log"), errors="replace") as f:
            panics[name] = sum("panicked" in line for line in f)
    for s in servers.values():
        s.kill(signal.SIGTERM)
    s3.kill(signal.SIGTERM)

    # Summary.
    rows = soak.rec.rows
    by_outcome = {}
    for r in rows:
        by_outcome[r[5]] = by_outcome.get(r[5], 0) + 1
    by_op = {}
    for r in rows:
        d = by_op.setdefault(r[1], {"requests": 0, "ok": 0, "latencies": []})
        d["requests"] += 1
        if r[5] == "ok":
            d["ok"] += 1
            d["latencies"].append(r[4])
    for d in by_op.values():
        lat = d.pop("latencies")
        d["p50_ms"] = round(1000 * percentile(lat, 0.5), 1) if lat else None
        d["p99_ms"] = round(1000 * percentile(lat, 0.99), 1) if lat else None
    defects = {k: v for k, v in by_outcome.items()
               if k not in EXPECTED}
    examples = {}
    for r in rows:
        if r[5] in defects and r[5] not in examples:
            examples[r[5]] = f"{r[1]} on {r[2]} at {r[0]} s: {r[6]}"
    rss_by = {n: [m for (_, s, m) in rss if s == n] for n in servers}
    half = duration / 2
    summary = {
        "command": " ".join(sys.argv),
        "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": machine(),
        "seconds": round(elapsed),
        "clients": args.clients,
        "requests": len(rows),
        "by_outcome": by_outcome,
        "by_op": by_op,
        "defects": defects,
        "defect_examples": examples,
        "faults": [{"name": n, "start_s": round(s, 1), "end_s": round(e, 1)} for s, e, n, _ in faults],
        "acknowledged_adds": len(ledger.present) + len(ledger.deleted) + len(ledger.unknown),
        "present_checked": len(ledger.present),
        "deletes_acknowledged": len(ledger.deleted),
        "fate_unknown": len(ledger.unknown),
        "adds_unacknowledged": ledger.adds_unacked,
        "lost": lost[:20], "lost_count": len(lost),
        "wrong_text": wrong[:20], "wrong_text_count": len(wrong),
        "resurrected": resurrected[:20], "resurrected_count": len(resurrected),
        "states_not_loading": half_written[:20], "states_not_loading_count": len(half_written),
        "states_loaded": len(loadable),
        "in_flight_after": in_flight,
        "panics_in_logs": panics,
        "rss_mib": {n: {"first_half_max": max([m for (t, s, m) in rss if s == n and t < half], default=None),
                        "second_half_max": max([m for (t, s, m) in rss if s == n and t >= half], default=None),
                        "max": max(v, default=None), "end": round(rss_end[n], 1)} for n, v in rss_by.items()},
    }
    ok = (not defects and not lost and not wrong and not resurrected and not half_written
          and all(v == 0 for v in in_flight.values()) and not any(panics.values()))
    summary["passed"] = ok
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.run, "requests.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(args.run, "rss.jsonl"), "w") as f:
        for r in rss:
            f.write(json.dumps(r) + "\n")
    write_timeline(os.path.join(args.out, "timeline.csv"), rows, rss, duration)
    write_markdown(os.path.join(args.out, "soak.md"), summary)
    plot(os.path.join(args.out, "soak.png"), rows, rss, summary["faults"], duration)
    log("passed" if ok else "FAILED", json.dumps({k: summary[k] for k in ("requests", "by_outcome", "lost_count")}))
    sys.exit(0 if ok else 1)


BUCKET = 10  # seconds per timeline row


def machine():
    """CPU model and core count, as /proc/cpuinfo names them."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"{os.cpu_count()} cores, {line.split(':', 1)[1].strip()}"
    return f"{os.cpu_count()} cores"


def write_timeline(path, rows, rss, duration):
    n = int(duration // BUCKET) + 1
    with open(path, "w") as f:
        f.write("t_s,requests,ok,expected_503,server_down,defects,p50_ms,p99_ms,rss_A_mib,rss_B_mib\n")
        for b in range(n):
            rs = [r for r in rows if b * BUCKET <= r[0] < (b + 1) * BUCKET]
            lat = [r[4] for r in rs if r[5] == "ok"]
            ra = [m for (t, s, m) in rss if s == "A" and b * BUCKET <= t < (b + 1) * BUCKET]
            rb = [m for (t, s, m) in rss if s == "B" and b * BUCKET <= t < (b + 1) * BUCKET]
            f.write(",".join(str(x) for x in [
                b * BUCKET, len(rs), sum(r[5] == "ok" for r in rs), sum(r[5] == "503_during_fault" for r in rs),
                sum(r[5] in SERVER_KILLED for r in rs),
                sum(r[5] not in EXPECTED for r in rs),
                round(1000 * percentile(lat, 0.5), 1) if lat else "", round(1000 * percentile(lat, 0.99), 1) if lat else "",
                max(ra) if ra else "", max(rb) if rb else ""]) + "\n")


def write_markdown(path, s):
    lines = [
        "# Soak: two servers on PostgreSQL + S3, faults injected",
        "",
        f"`{s['command']}` (revision {s['revision']}, {s['machine']}, {s['seconds']} s)",
        "",
        f"**{'Passed' if s['passed'] else 'FAILED'}.** {s['requests']:,} requests from {s['clients']} clients; "
        f"{s['acknowledged_adds']:,} contexts added and acknowledged, {s['deletes_acknowledged']:,} deletes acknowledged; "
        f"after the run {s['lost_count']} acknowledged contexts were missing, {s['wrong_text_count']} had another text, "
        f"{s['resurrected_count']} deleted ones came back, {s['states_not_loading_count']} of {s['states_loaded']:,} states "
        f"failed to load. Requests in flight afterwards: {s['in_flight_after']}. Panics in the logs: {s['panics_in_logs']}.",
        "",
        "| outcome | requests |", "|---|---:|",
    ]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(s["by_outcome"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| request | sent | ok | p50 ms (ok) | p99 ms (ok) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {op} | {d['requests']:,} | {d['ok']:,} | {d['p50_ms']} | {d['p99_ms']} |" for op, d in sorted(s["by_op"].items())]
    lines += ["", "| fault | from (s) | to (s) |", "|---|---:|---:|"]
    lines += [f"| {f['name']} | {f['start_s']} | {f['end_s']} |" for f in s["faults"]]
    lines += ["", "| server | RSS max, first half (MiB) | RSS max, second half | after the check (every state loaded) |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {d['first_half_max']} | {d['second_half_max']} | {round(d['end'], 1)} |" for n, d in s["rss_mib"].items()]
    if s["defect_examples"]:
        lines += ["", "Defects (first of each kind):", ""] + [f"- {k}: {v}" for k, v in s["defect_examples"].items()]
    lines += ["", "![soak](soak.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(path, rows, rss, faults, duration):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(duration // BUCKET) + 1
    ts = [b * BUCKET / 60 for b in range(n)]

    def per_bucket(pred):
        counts = [0] * n
        for r in rows:
            b = int(r[0] // BUCKET)
            if b < n and pred(r):
                counts[b] += 1
        return [c / BUCKET for c in counts]

    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax[0].plot(ts, per_bucket(lambda r: r[5] == "ok"), label="answered", color="tab:green")
    ax[0].set_ylabel("requests/s")
    ax[0].set_title("Soak: 2 servers on PostgreSQL + S3, faults shaded")
    ax[1].plot(ts, per_bucket(lambda r: r[5] == "503_during_fault"), label="503 during a fault", color="tab:orange")
    ax[1].plot(ts, per_bucket(lambda r: r[5] in SERVER_KILLED), label="refused or cut off (server killed)",
               color="tab:purple")
    ax[1].plot(ts, per_bucket(lambda r: r[5] not in EXPECTED),
               label="anything else (defects)", color="tab:red")
    ax[1].set_ylabel("errors/s")
    for op_group, color in [(("add",), "tab:blue"), (("complete_retrieve", "complete_ids"), "tab:brown")]:
        p50, p99 = [], []
        for b in range(n):
            lat = [r[4] for r in rows if r[1] in op_group and r[5] == "ok" and int(r[0] // BUCKET) == b]
            p50.append(1000 * percentile(lat, 0.5) if lat else float("nan"))
            p99.append(1000 * percentile(lat, 0.99) if lat else float("nan"))
        label = "add context" if op_group == ("add",) else "completion"
        ax[2].plot(ts, p50, color=color, label=f"{label} p50")
        ax[2].plot(ts, p99, color=color, linestyle="--", label=f"{label} p99")
    ax[2].set_ylabel("latency, ms")
    ax[2].set_yscale("log")
    for name, color in [("A", "tab:blue"), ("B", "tab:cyan")]:
        pts = [(t / 60, m) for (t, s, m) in rss if s == name]
        ax[3].plot([p[0] for p in pts], [p[1] for p in pts], label=f"server {name}", color=color)
    ax[3].set_ylabel("RSS, MiB")
    ax[3].set_ylim(bottom=0)
    ax[3].set_xlabel("minutes")
    for a in ax:
        for f in faults:
            a.axvspan(f["start_s"] / 60, f["end_s"] / 60, color="grey", alpha=0.25)
        a.legend(loc="upper right", fontsize=8)
        a.grid(alpha=0.3)
    for f in faults:
        ax[0].annotate(f["name"], (f["start_s"] / 60, 0), fontsize=7, rotation=90, va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
