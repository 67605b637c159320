#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for examples/slurm/train.sbatch and its test.
#
#   bash scripts/slurm-local.sh          # install (once), configure, start; idempotent (a
#                                        # changed configuration restarts the daemons with it)
#   bash scripts/slurm-local.sh stop     # stop slurmctld, slurmd and munged
#
# Needs root (apt-get, daemons). Installs Debian's slurm-wlm and munge when missing, writes
# /etc/slurm/slurm.conf for one node (this host, its real core count and memory: a job asking
# for more tasks than cores is refused by sbatch, as on a real cluster), starts munged,
# slurmctld and slurmd, and waits (60 s at most) for the node to be idle. Exit status 0 when
# the cluster is up; otherwise 1 and the reason on stderr (tests skip with that reason).
set -euo pipefail
STATE=${TANDEM_SLURM_STATE:-/var/lib/tandem-slurm}
CONF=/etc/slurm/slurm.conf

fail() { echo "slurm-local: $*" >&2; exit 1; }

if [ "${1:-}" = stop ]; then
  for daemon in slurmd slurmctld munged; do  # by the pid each wrote, never by name
    if [ -f "$STATE/$daemon.pid" ]; then kill "$(cat "$STATE/$daemon.pid")" 2>/dev/null || true; fi
  done
  exit 0
fi

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, munged, slurmd); run it as root or under sudo"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || fail "slurmctld/munged are missing and there is no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || fail "apt-get update failed"
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
    || fail "apt-get install slurm-wlm munge failed"
fi

mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm /run/munge /var/log/munge /var/lib/munge
# -- munge: SLURM's authentication ------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged --force 2>/dev/null || munged --force || fail "munged did not start"
  pgrep -u munge -n munged > "$STATE/munged.pid" || true
fi

# -- slurm.conf: this host is the controller and the only node ---------------------------------
HOST=$(hostname -s)
NODE=$(slurmd -C | head -1)  # NodeName=<host> CPUs=N ... RealMemory=M, as slurmd sees them
cat > "$CONF.new" <<CONFEOF
# written by tandem's scripts/slurm-local.sh: a one-node cluster for tests and examples
ClusterName=tandem
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# a job asking for more than the node has is refused at submission, not left pending forever
EnforcePartLimits=ALL
SlurmdTimeout=60
# Requeue (sbatch --requeue, scontrol requeue: a preempted tandem job requeues itself) is on. A
# requeued job may start again cred_expire seconds later, seen by a scheduling pass every
# sched_interval seconds: SLURM's defaults (120 s, 60 s) would make every requeue test wait
# minutes; a real cluster keeps its own.
JobRequeue=1
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2
$NODE State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONFEOF

if cmp -s "$CONF.new" "$CONF" && pgrep -x slurmctld >/dev/null && pgrep -x slurmd >/dev/null \
    && sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
  rm -f "$CONF.new"
  exit 0  # already running, with this configuration
fi
if ! cmp -s "$CONF.new" "$CONF"; then  # another configuration: the daemons start again with it
  for daemon in slurmd slurmctld; do  # by the pid each wrote, never by name
    if [ -f "$STATE/$daemon.pid" ]; then
      pid=$(cat "$STATE/$daemon.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
  done
fi
mv "$CONF.new" "$CONF"

pgrep -x slurmctld >/dev/null || slurmctld -i >/dev/null 2>&1 \
  || fail "slurmctld did not start: see $STATE/slurmctld.log"
pgrep -x slurmd >/dev/null || slurmd >/dev/null 2>&1 || fail "slurmd did not start: see $STATE/slurmd.log"

for _ in $(seq 60); do  # the node registers, then becomes idle
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    exit 0
  fi
  scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
  sleep 1
done
fail "the node did not become idle in 60 s: $(sinfo -h 2>&1 | head -3); see $STATE/slurmd.log"
