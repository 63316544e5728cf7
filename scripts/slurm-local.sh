#!/usr/bin/env bash
# A throwaway one-node SLURM cluster on this machine, for kvbench's `slurm` tests (CI and local).
#
#   scripts/slurm-local.sh up      install Debian's slurm + munge (+ slurmdbd, MariaDB) if missing,
#                                  write configs, start the daemons, wait for an idle node
#   scripts/slurm-local.sh down    cancel jobs, stop what `up` started, remove its configs
#   scripts/slurm-local.sh check   exit 0 when a job can run now (sinfo shows an idle node)
#
# Needs root (daemons, /etc/slurm). Accounting (slurmdbd on MariaDB) is on: without it submitit
# cannot tell that a job was cancelled or killed and waits for it forever.
# Environment: KVBENCH_SLURM_DIR (state, logs; default /tmp/kvbench-slurm),
#              KVBENCH_SLURM_PARTITION (default debug), KVBENCH_SLURM_DB_PORT (default 13307).
set -euo pipefail

STATE=${KVBENCH_SLURM_DIR:-/tmp/kvbench-slurm}
PARTITION=${KVBENCH_SLURM_PARTITION:-debug}
DB_PORT=${KVBENCH_SLURM_DB_PORT:-13307}
TAG="# written by kvbench scripts/slurm-local.sh"
SLURM_CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf

say() { echo "[slurm-local] $*" >&2; }
fail() { say "cannot start: $*"; exit 1; }

until_ok() {  # until_ok SECONDS CMD...: retry CMD every 0.2 s for up to SECONDS
    local deadline=$((SECONDS + $1)); shift
    while ! "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

ours_or_absent() { [ ! -e "$1" ] || grep -qxF "$TAG" "$1"; }

install_packages() {
    local need=()
    for bin in munged slurmctld slurmd sbatch slurmdbd mariadbd; do
        command -v "$bin" >/dev/null || need+=("$bin")
    done
    [ ${#need[@]} -eq 0 ] && return 0
    say "installing Debian packages (missing: ${need[*]})"
    apt-get update -qq >/dev/null || fail "apt-get update failed (no access to Debian's mirrors?)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        munge slurmctld slurmd slurm-client slurmdbd mariadb-server >/dev/null \
        || fail "apt-get install of slurm, munge, slurmdbd and mariadb-server failed"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$STATE/pids/munged"
    until_ok 10 sh -c 'munge -n | unmunge' || fail "munged did not answer"
}

start_database() {
    local sock="$STATE/mysql.sock"
    if [ ! -d "$STATE/db/mysql" ]; then
        mariadb-install-db --no-defaults --user=root --datadir="$STATE/db" \
            --auth-root-authentication-method=socket --skip-test-db >"$STATE/logs/db-init.log" 2>&1 \
            || fail "mariadb-install-db failed ($STATE/logs/db-init.log)"
    fi
    setsid mariadbd --no-defaults --user=root --datadir="$STATE/db" --socket="$sock" \
        --pid-file="$STATE/pids/mariadbd" --bind-address=127.0.0.1 --port="$DB_PORT" \
        --log-error="$STATE/logs/mariadbd.log" --innodb-buffer-pool-size=32M </dev/null >/dev/null 2>&1 &
    until_ok 30 mariadb --no-defaults -S "$sock" -uroot -e 'select 1' || fail "MariaDB did not start"
    mariadb --no-defaults -S "$sock" -uroot -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' \
        IDENTIFIED BY 'kvbench'; GRANT ALL ON kvbench_acct.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    {
        echo "$TAG"
        echo "AuthType=auth/munge"
        echo "DbdHost=localhost"
        echo "DbdAddr=127.0.0.1"
        echo "DbdPort=6829"
        echo "SlurmUser=root"
        echo "PidFile=$STATE/pids/slurmdbd"
        echo "LogFile=$STATE/logs/slurmdbd.log"
        echo "StorageType=accounting_storage/mysql"
        echo "StorageHost=127.0.0.1"
        echo "StoragePort=$DB_PORT"
        echo "StorageUser=slurm"
        echo "StoragePass=kvbench"
        echo "StorageLoc=kvbench_acct"
    } >"$DBD_CONF"
    chmod 600 "$DBD_CONF"
}

write_slurm_conf() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    cat >"$SLURM_CONF" <<EOF
$TAG
ClusterName=kvbench
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6827
SlurmdPort=6828
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/pids/slurmctld
SlurmdPidFile=$STATE/pids/slurmd
SlurmctldLogFile=$STATE/logs/slurmctld.log
SlurmdLogFile=$STATE/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
KillWait=5
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6829
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

up() {
    [ "$(id -u)" = 0 ] || fail "needs root"
    ours_or_absent "$SLURM_CONF" || fail "$SLURM_CONF exists and is not ours"
    ours_or_absent "$DBD_CONF" || fail "$DBD_CONF exists and is not ours"
    install_packages
    mkdir -p "$STATE"/{ctld,spool,logs,pids} /etc/slurm
    start_munge
    start_database
    write_slurm_conf
    /usr/sbin/slurmdbd
    until_ok 30 sacctmgr -n -P list cluster || fail "slurmdbd did not start ($STATE/logs/slurmdbd.log)"
    /usr/sbin/slurmctld
    /usr/sbin/slurmd
    until_ok 60 sh -c "sinfo -h -o %T | grep -qx idle" || fail "the node is not idle ($STATE/logs/)"
    srun -p "$PARTITION" -N1 -n1 -t 1 true || fail "a test job did not run"
    say "up: partition $PARTITION on $(hostname -s), $(nproc) CPUs; logs in $STATE/logs"
}

stop_pid() {  # stop_pid NAME: SIGTERM the pid in $STATE/pids/NAME, SIGKILL after 15 s
    local file="$STATE/pids/$1" pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$1" ]; then
        kill "$pid" 2>/dev/null || true
        until_ok 15 sh -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

down() {
    if [ -s "$STATE/pids/slurmctld" ]; then
        scancel -p "$PARTITION" 2>/dev/null || true
        until_ok 20 sh -c '[ -z "$(squeue -h -o %i)" ]' || say "jobs still queued; stopping anyway"
    fi
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do stop_pid "$daemon"; done
    for conf in "$SLURM_CONF" "$DBD_CONF"; do
        [ -e "$conf" ] && grep -qxF "$TAG" "$conf" && rm -f "$conf"
    done
    rm -rf "$STATE"
    say "down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    check) sinfo -h -o %T 2>/dev/null | grep -qx idle ;;
    *) echo "usage: $0 up|down|check" >&2; exit 2 ;;
esac
