#!/usr/bin/env python3
"""Serving throughput and latency of an OpenAI-style completions server under concurrent clients.

Each of N clients sends streaming `POST /v1/completions` requests one after another (a prompt of
--prompt-tokens token ids, --max-tokens new tokens, greedy unless --temperature); all N start
together. Reported per N: aggregate generated tokens/s (all tokens of all clients over the wall
time), p50/p99 time to first token, p50/p99 inter-token latency (gaps between streamed chunks),
and requests refused (503).
Works against `picaso serve` and llama.cpp's `llama-server` alike (both take token-id prompts;
`ignore_eos` is sent for llama-server, which honours it; picaso's count is what it generated).

Standard library only. Usage:
  scripts/bench_serving.py --url http://127.0.0.1:8080 --clients 1,4,16,32 --name picaso --json out.json
"""

import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def one_request(url, prompt, max_tokens, model, sampling=None):
    """Streams one completion; returns (ttft s, [inter-chunk gaps s], tokens, status).
    `sampling`: request fields that replace greedy decoding (temperature, top_p, seed)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "model": model, **(sampling or {})}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        conn.close()
        return None, [], 0, resp.status
    ttft, last, gaps, chunks, usage = None, None, [], 0, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"].get("completion_tokens")
        text = (ev.get("choices") or [{}])[0].get("text") or ev.get("content") or ""
        if not text:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
    conn.close()
    return ttft, gaps, usage if usage is not None else chunks, 200


def run_level(url, clients, requests_per_client, prompt_tokens, max_tokens, vocab, model, sampling=None):
    rng = random.Random(clients)
    prompts = [[rng.randrange(2, vocab) for _ in range(prompt_tokens)] for _ in range(clients)]
    results, lock = [], threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(i):
        start.wait()
        for _ in range(requests_per_client):
            r = one_request(url, prompts[i], max_tokens, model, sampling and {**sampling, "seed": i})
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r[3] == 200]
    tokens = sum(r[2] for r in ok)
    ttfts = [r[0] for r in ok if r[0] is not None]
    gaps = [g for r in ok for g in r[1]]
    return {
        "clients": clients,
        "requests": len(results),
        "refused": sum(1 for r in results if r[3] != 200),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="server")
    ap.add_argument("--model", default="", help="model name sent in requests")
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=50000, help="prompt ids are drawn from [2, vocab)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature instead of greedy (each client its own seed)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, with --temperature")
    ap.add_argument("--json", help="append one JSON line per level here")
    a = ap.parse_args()
    sampling = {"temperature": a.temperature, "top_p": a.top_p} if a.temperature > 0 else None
    # One short request first: loads caches, starts threads.
    one_request(a.url, [2, 3, 4], 2, a.model)
    for n in [int(x) for x in a.clients.split(",")]:
        r = run_level(a.url, n, a.requests_per_client, a.prompt_tokens, a.max_tokens, a.vocab, a.model, sampling)
        r["engine"] = a.name
        r["temperature"], r["top_p"] = a.temperature, a.top_p
        print(f"{a.name:>10} clients={n:>3}  {r['tokens_per_s']:8.1f} tok/s  ttft p50/p99 "
              f"{r['ttft_p50_ms']:7.1f}/{r['ttft_p99_ms']:7.1f} ms  itl p50/p99 "
              f"{r['itl_p50_ms']:6.1f}/{r['itl_p99_ms']:6.1f} ms  tokens={r['tokens']} refused={r['refused']}",
              flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
