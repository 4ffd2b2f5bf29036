#!/usr/bin/env bash
# A one-machine SLURM for the tests: Debian's slurm-wlm (slurmctld + slurmd on localhost,
# munge authentication), 2 CPUs in one partition. Idempotent; needs root and apt.
#   tests/slurm/start_slurm.sh            # install if missing, configure, start, wait
# Exit code 0: `sinfo` shows the node idle. Anything else: SLURM is not available here.
set -euo pipefail

if ! command -v slurmctld >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null
fi

# munge: a key, then the daemon (as its own user)
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged
fi

cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=freetx
SlurmctldHost=localhost
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
KillWait=30
NodeName=localhost CPUs=${cpus} RealMemory=${memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
cp /etc/slurm/slurm.conf /etc/slurm-llnl/slurm.conf 2>/dev/null || true

pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 1 60); do
  if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    exit 0
  fi
  scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "SLURM did not come up: $(sinfo 2>&1 | tail -2)" >&2
exit 1
