#!/usr/bin/env bash
# RELIABILITY.md's "Hostile templates": starts `picaso serve` on the bundled model (a store of
# two contexts, request templates trusted where the binary knows the flag), sends the template
# bombs with scripts/template_bombs.py, stops the server.
#
#   scripts/template_bombs.sh [PICASO_BINARY] [AS_LIMIT_GB]
#
# AS_LIMIT_GB (default 12) caps the server's address space with `ulimit -v`: a server without
# budgets grows until the kernel kills it, and on a shared machine the cap keeps it from taking
# the machine with it (it then aborts on a failed allocation instead).
set -euo pipefail
bin=${1:-target/release/picaso}
limit_gb=${2:-12}
run=$(mktemp -d /tmp/picaso-bombs.XXXX)
trap 'kill $(cat "$run/pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$run"' EXIT
mkdir -p "$run/docs"
printf 'The Eiffel Tower is in Paris.\n\nIt was finished in 1889.\n' > "$run/docs/eiffel.txt"
embedder=${PICASO_EMBEDDER:-../shared/data/all-MiniLM-L6-v2}
"$bin" ingest --db "$run/db" --model models/picaso-mamba2 --embedder "$embedder" --text-dir "$run/docs" >/dev/null
trust=()
if "$bin" serve --help | grep -q -- --trust-request-chat-template; then trust=(--trust-request-chat-template); fi
(ulimit -v $((limit_gb << 20)); exec "$bin" serve --db "$run/db" --model models/picaso-mamba2 --embedder "$embedder" \
  --addr 127.0.0.1:0 "${trust[@]}" >"$run/out" 2>"$run/err") &
echo $! > "$run/pid"
for _ in $(seq 600); do grep -q listening "$run/out" 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$run/out")
python3 scripts/template_bombs.py --url "$url" --pid "$(cat "$run/pid")" --timeout 60
