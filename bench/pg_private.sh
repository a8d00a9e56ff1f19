#!/bin/sh
# A PostgreSQL cluster of the bench's own, with pg_stat_statements loaded (bench/README.md,
# "Where the time goes on PostgreSQL"). The shared server (127.0.0.1:5432) has no
# shared_preload_libraries and is not ours to restart; this one is: initdb and pg_ctl from
# Debian's server binaries, as the postgres user, in a folder of its own, on a port of its
# own, with the shared server's settings that matter here (fsync, synchronous_commit,
# wal_sync_method fdatasync, shared_buffers 128 MB, autovacuum off).
#
#   bench/pg_private.sh start [DIR] [PORT]   # prints the RELAY_TEST_PG to export
#   RELAY_TEST_PG=postgresql://root@127.0.0.1:55432/test .venv/bin/python bench/pg_writer.py
#   bench/pg_private.sh stop [DIR]           # stops it and removes DIR
set -eu
PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
DIR=${2:-/tmp/relay-bench-pg}
PORT=${3:-55432}
as_pg() { su postgres -s /bin/sh -c "$*"; }
case "${1:-}" in
start)
    mkdir -p "$DIR"
    chown postgres "$DIR"
    as_pg "$PGBIN/initdb -D $DIR/data -A trust -U postgres >$DIR/initdb.log"
    as_pg "$PGBIN/pg_ctl -D $DIR/data -l $DIR/server.log -w -o \"-p $PORT -k $DIR \
        -c listen_addresses=127.0.0.1 -c shared_preload_libraries=pg_stat_statements \
        -c pg_stat_statements.track_utility=on -c shared_buffers=128MB -c autovacuum=off \
        -c wal_sync_method=fdatasync -c fsync=on -c synchronous_commit=on\" start" >/dev/null
    as_pg "psql -h $DIR -p $PORT -U postgres -qc 'CREATE ROLE root SUPERUSER LOGIN'"
    as_pg "psql -h $DIR -p $PORT -U postgres -qc 'CREATE DATABASE test OWNER root'"
    as_pg "psql -h $DIR -p $PORT -U postgres -d test -qc 'CREATE EXTENSION pg_stat_statements'"
    echo "RELAY_TEST_PG=postgresql://root@127.0.0.1:$PORT/test"
    ;;
stop)
    as_pg "$PGBIN/pg_ctl -D $DIR/data -m fast -w stop" >/dev/null || true
    rm -rf "$DIR"
    ;;
*)
    echo "usage: $0 start|stop [DIR] [PORT]" >&2
    exit 2
    ;;
esac
