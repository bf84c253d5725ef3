#!/bin/sh
# The part of the postgres image's entrypoint that docker-compose.yml relies on: an empty data directory gets a
# cluster whose superuser, password and database are POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB; then the
# server runs in the foreground, listening on the container's network with password authentication.
set -eu
bin=/usr/lib/postgresql/15/bin
: "${PGDATA:=/var/lib/postgresql/data}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    "$bin/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -E UTF8 \
        --auth-local=trust --auth-host=scram-sha-256 > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    database=${POSTGRES_DB:-$POSTGRES_USER}
    if [ "$database" != postgres ]; then
        echo "CREATE DATABASE \"$database\";" | "$bin/postgres" --single -D "$PGDATA" postgres > /dev/null
    fi
fi
if [ "${1:-postgres}" = postgres ]; then
    [ "$#" -gt 0 ] && shift
    exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
