#!/usr/bin/env python3
"""Conversations and agents against an OpenAI-style chat server: what a prefix cache saves.

Two workloads, each on text no other workload uses (so one cannot warm the cache for another):
* conversation: --turns turns, each adding a user message of ~--turn-tokens tokens and an answer
  of --answer-tokens tokens (greedy, end of text ignored) sent back as history, replayed by each
  of --clients concurrent clients (a list: 1,8 runs 1 client, then 8), each its own conversation;
* agents: --agents clients that start together, each sending one request: a shared system prompt
  of ~--system-tokens tokens and its own user message of ~50 tokens.
Reported per turn (conversation) and per workload: time to first token (first streamed chunk
with text, measured by the client) and prompt tokens prefilled: picaso's `usage.prompt_tokens`
less `usage.prompt_tokens_details.cached_tokens`, llama-server's `timings.prompt_n`.

Works against `picaso serve --chat-template ...` and llama.cpp's `llama-server --jinja
--chat-template-file ...` (streamed chat completions with `cache_prompt`). Standard library only.
  scripts/bench_prefix_cache.py --url http://127.0.0.1:8080 --name picaso --text wiki.valid.tokens --json out.jsonl
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def post(url, path, body, timeout=1800):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    return conn, conn.getresponse()


def count_tokens(url, text):
    """Tokens of `text` by the server's tokenizer (picaso's and llama-server's /tokenize)."""
    for body in ({"prompt": text}, {"content": text}):
        conn, resp = post(url, "/tokenize", body)
        data = resp.read()
        conn.close()
        if resp.status == 200:
            v = json.loads(data)
            n = v.get("count") or len(v.get("tokens") or [])
            if n:  # llama-server answers {"tokens": []} to picaso's shape
                return n
    raise SystemExit("the server has no /tokenize")


class Texts:
    """Consecutive pieces of a corpus, each of about n tokens (by the server's tokenizer)."""

    def __init__(self, path, url):
        words = open(path, encoding="utf-8").read().split()
        self.words = [w for w in words if w not in ("@-@", "@,@", "@.@", "=")]
        self.at = 0
        sample = " ".join(self.words[:2000])
        self.per_word = count_tokens(url, sample) / 2000

    def take(self, n):
        k = max(1, round(n / self.per_word))
        piece = " ".join(self.words[self.at:self.at + k])
        self.at += k
        return piece


EXTRA = {}  # request fields for one server only (llama-server's cache_prompt)


def chat(url, messages, max_tokens, model):
    """Streams one chat completion: (ttft s, answer text, prompt tokens, prefilled tokens)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "model": model, "stream_options": {"include_usage": True}, **EXTRA}
    t0 = time.perf_counter()
    conn, resp = post(url, "/v1/chat/completions", body)
    if resp.status != 200:
        raise SystemExit(f"{resp.status}: {resp.read()[:500]}")
    ttft, text, usage, timings = None, [], None, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        usage = ev.get("usage") or usage
        timings = ev.get("timings") or timings
        for c in ev.get("choices") or []:
            piece = (c.get("delta") or {}).get("content") or ""
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    conn.close()
    prompt = usage["prompt_tokens"] if usage else None
    if timings and "prompt_n" in timings:  # llama-server: tokens it evaluated
        prefilled = timings["prompt_n"]
        prompt = prompt or timings["prompt_n"] + timings.get("cache_n", 0)
    else:
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        prefilled = prompt - cached
    return ttft, "".join(text), prompt, prefilled


def conversation(url, model, texts, turns, turn_tokens, answer_tokens, clients):
    """`clients` conversations at once; per turn, each client's (ttft, prompt, prefilled)."""
    users = [[texts.take(turn_tokens) for _ in range(turns)] for _ in range(clients)]
    results = [[None] * turns for _ in range(clients)]
    start = threading.Barrier(clients)

    def run(c):
        messages = []
        start.wait()
        for t in range(turns):
            messages.append({"role": "user", "content": users[c][t]})
            ttft, answer, prompt, prefilled = chat(url, messages, answer_tokens, model)
            results[c][t] = (ttft, prompt, prefilled)
            messages.append({"role": "assistant", "content": answer})

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return results


def agents(url, model, texts, n, system_tokens, answer_tokens):
    system = texts.take(system_tokens)
    users = [texts.take(50) for _ in range(n)]
    results = [None] * n
    start = threading.Barrier(n)

    def run(i):
        start.wait()
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": users[i]}]
        results[i] = chat(url, msgs, answer_tokens, model)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    return [(r[0], r[2], r[3]) for r in results], wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", required=True, help="label of the server in the output")
    ap.add_argument("--model", default="")
    ap.add_argument("--text", required=True, help="a text corpus (WikiText's wiki.valid.tokens)")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--json", help="append JSON lines here")
    ap.add_argument("--cache-prompt", action="store_true", help="send llama-server's cache_prompt: true")
    a = ap.parse_args()
    if a.cache_prompt:
        EXTRA["cache_prompt"] = True
    texts = Texts(a.text, a.url)
    out = []
    for clients in [int(c) for c in a.clients.split(",") if c]:
        res = conversation(a.url, a.model, texts, a.turns, a.turn_tokens, a.answer_tokens, clients)
        for t in range(a.turns):
            ttfts = [res[c][t][0] for c in range(clients)]
            row = {"server": a.name, "workload": "conversation", "clients": clients, "turn": t + 1,
                   "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts),
                   "prompt_tokens": sum(res[c][t][1] for c in range(clients)),
                   "prefilled_tokens": sum(res[c][t][2] for c in range(clients))}
            out.append(row)
            print(json.dumps(row), flush=True)
    if a.agents:
        res, wall = agents(a.url, a.model, texts, a.agents, a.system_tokens, a.answer_tokens)
        ttfts = [r[0] for r in res]
        row = {"server": a.name, "workload": "agents", "clients": a.agents, "wall_s": wall,
               "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts),
               "prompt_tokens": sum(r[1] for r in res), "prefilled_tokens": sum(r[2] for r in res)}
        out.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
