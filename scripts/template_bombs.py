#!/usr/bin/env python3
"""Chat-template bombs against a running `picaso serve`, as RELIABILITY.md ("Hostile templates")
reports them: the eight bombs of crates/server/tests/fixtures/template_bombs.json sent at once
as `chat_template`s, while /health is polled every 50 ms, an ordinary completion is sent, and
the server's resident memory is sampled. Prints a markdown table and one JSON line.

    scripts/template_bombs.sh [PICASO_BINARY]     # starts a server, runs this, stops it

    python3 scripts/template_bombs.py --url http://127.0.0.1:8080 --pid PID [--timeout 60]
"""
import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def post(url, body, timeout):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except Exception as e:  # noqa: BLE001 - the outcome is what is reported
        return None, {"error": {"message": f"{type(e).__name__}: {e}"}}


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (its memory is sampled)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds a request may take before it counts as no answer")
    args = ap.parse_args()
    with open(os.path.join(HERE, "../crates/server/tests/fixtures/template_bombs.json")) as f:
        bombs = json.load(f)
    chat = f"{args.url}/v1/chat/completions"
    message = [{"role": "user", "content": "Hello there"}]
    # Warm up with a plain request template; then the idle size.
    post(chat, {"messages": message, "max_tokens": 4, "chat_template": CHATML}, args.timeout)
    idle = rss_mib(args.pid)
    done = threading.Event()
    peak, health = [idle or 0], []

    def sample():
        while not done.is_set():
            m = rss_mib(args.pid)
            if m is None:
                break
            peak[0] = max(peak[0], m)
            time.sleep(0.02)

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{args.url}/health", timeout=args.timeout) as r:
                    ok = r.status == 200
            except Exception:  # noqa: BLE001
                ok = False
            health.append((time.perf_counter() - t, ok))
            if not ok and rss_mib(args.pid) is None:
                break
            time.sleep(0.05)

    results = [None] * len(bombs)

    def attack(i, bomb):
        t = time.perf_counter()
        status, v = post(chat, {"messages": message, "max_tokens": 4, "chat_template": bomb["template"]}, args.timeout)
        msg = ((v or {}).get("error") or {}).get("message", "") if isinstance(v, dict) else ""
        results[i] = {"bomb": bomb["name"], "status": status, "seconds": round(time.perf_counter() - t, 3),
                      "message": msg[:100]}

    threads = [threading.Thread(target=sample), threading.Thread(target=poll)]
    threads += [threading.Thread(target=attack, args=(i, b)) for i, b in enumerate(bombs)]
    for th in threads:
        th.start()
    time.sleep(0.2)
    t = time.perf_counter()
    status, v = post(chat, {"messages": message, "max_tokens": 4, "chat_template": CHATML}, args.timeout)
    ordinary = {"status": status, "seconds": round(time.perf_counter() - t, 3)}
    for th in threads[2:]:
        th.join()
    done.set()
    for th in threads[:2]:
        th.join()
    alive = rss_mib(args.pid) is not None
    worst = max((s for s, _ in health), default=None)
    failed = sum(1 for _, ok in health if not ok)
    print("| bomb | status | seconds to answer | message |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['bomb']} | {r['status']} | {r['seconds']:.2f} | {r['message']} |")
    print(f"\nordinary completion: {ordinary['status']} in {ordinary['seconds']:.3f} s; /health: {len(health)} polls, "
          f"worst {worst:.3f} s, {failed} failed; resident memory idle {idle:.0f} MiB, peak {peak[0]:.0f} MiB "
          f"(+{peak[0] - (idle or 0):.0f}); server {'alive' if alive else 'DEAD'} at the end")
    print(json.dumps({"bombs": results, "ordinary": ordinary, "health_polls": len(health), "health_worst_s": worst,
                      "health_failed": failed, "rss_idle_mib": idle, "rss_peak_mib": peak[0], "alive": alive}))


if __name__ == "__main__":
    main()
