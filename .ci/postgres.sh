#!/usr/bin/env bash
# Install (Debian's package) and start PostgreSQL on loopback for the test suite; print the admin URL.
# Sourced by .ci/run, which exports GOVTRAIN_TEST_PG_URL from it. Safe to run again.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
if ! pg_lsclusters -h | grep -q "^$version main"; then
  pg_createcluster "$version" main >&2
fi
if ! pg_lsclusters -h | grep -q "^$version main .* online"; then
  pg_ctlcluster "$version" main start >&2
fi
for _ in $(seq 1 30); do
  su postgres -c "psql -qtAc 'select 1'" >/dev/null 2>&1 && break
  sleep 1
done
su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'govtrain-test'\"" >&2
echo "postgresql+psycopg://postgres:govtrain-test@127.0.0.1:5432/postgres"
