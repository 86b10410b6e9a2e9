#!/usr/bin/env python3
"""A long mixed load on `picaso serve` checking that the prefix cache stays within its budget.

--clients threads for --seconds, each picking at random: a turn of its own conversation (which
grows until it restarts), an agent request with one of a few shared system prompts, a completion
of a fresh random prompt, one with contexts (--contexts ids), or an echo with log-probs. Every
second /metrics is read: `picaso_prefix_cache_bytes` must never pass --budget-mb, and the
server's resident memory (--pid, from /proc) is sampled. Prints one JSON line at the end and
exits 1 if the budget was ever passed or a request failed.
  scripts/soak_prefix_cache.py --url http://127.0.0.1:8080 --pid PID --budget-mb 64 --seconds 600
"""

import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse

WORDS = ("tower river city season album party film church species ship war team election "
         "garden museum bridge station island market forest valley harbour castle road").split()


def post(url, path, body):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def metrics(url):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("picaso_prefix_cache"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def rss_mb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--budget-mb", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--contexts", default="1,2", help="context ids some requests compose")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",") if c]
    systems = [words(random.Random(s), 300) for s in range(3)]
    stop = time.time() + a.seconds
    counts, failures, lock = {}, [], threading.Lock()

    def client(c):
        rng = random.Random(c)
        conv = []
        while time.time() < stop:
            kind = rng.choice(["turn", "turn", "agent", "fresh", "contexts", "echo"])
            if kind == "turn":
                if len(conv) > 20:
                    conv = []
                conv.append({"role": "user", "content": words(rng, rng.randint(20, 200))})
                body = {"messages": conv, "max_tokens": 8, "temperature": 0}
                path = "/v1/chat/completions"
            elif kind == "agent":
                msgs = [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": words(rng, 30)}]
                body, path = {"messages": msgs, "max_tokens": 8, "temperature": 0}, "/v1/chat/completions"
            elif kind == "fresh":
                body, path = {"prompt": words(rng, rng.randint(10, 600)), "max_tokens": 4}, "/v1/completions"
            elif kind == "contexts":
                ids = rng.sample(contexts, rng.randint(1, len(contexts)))
                body = {"prompt": words(rng, 40), "max_tokens": 4, "contexts": ids}
                path = "/v1/completions"
            else:
                body = {"prompt": words(rng, 50), "max_tokens": 2, "echo": True, "logprobs": 1}
                path = "/v1/completions"
            status, data = post(a.url, path, body)
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
                if status != 200:
                    failures.append((kind, status, data[:200].decode("utf-8", "replace")))
            if kind == "turn" and status == 200:
                conv.append({"role": "assistant", "content": json.loads(data)["choices"][0]["message"]["content"]})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    [t.start() for t in threads]
    peak_bytes, peak_rss, rss = 0.0, 0.0, []
    while any(t.is_alive() for t in threads):
        m = metrics(a.url)
        peak_bytes = max(peak_bytes, m.get("picaso_prefix_cache_bytes", 0))
        r = rss_mb(a.pid) if a.pid else None
        if r:
            rss.append(r)
            peak_rss = max(peak_rss, r)
        time.sleep(1)
    [t.join() for t in threads]
    m = metrics(a.url)
    budget = a.budget_mb * 1048576
    report = {"seconds": a.seconds, "clients": a.clients, "requests": counts, "failures": len(failures),
              "peak_prefix_cache_mb": peak_bytes / 1048576, "budget_mb": a.budget_mb,
              "rss_mb_first_minute_max": max(rss[:60]) if rss else None, "rss_mb_peak": peak_rss or None,
              "rss_mb_last": rss[-1] if rss else None, **{k: v for k, v in m.items()}}
    print(json.dumps(report))
    for f in failures[:5]:
        print("failed:", f)
    raise SystemExit(1 if failures or peak_bytes > budget else 0)


if __name__ == "__main__":
    main()
