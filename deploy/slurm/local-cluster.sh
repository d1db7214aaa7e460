#!/bin/bash
# A one-node Slurm cluster on this machine, for trying deploy/slurm/train.sbatch and for its test
# (tests/faults/test_multinode.py): munged, slurmctld and slurmd, run as the calling user, with every file
# under DIR and the ports given.
#
#   deploy/slurm/local-cluster.sh start DIR CTLD_PORT SLURMD_PORT   # then: export SLURM_CONF=DIR/slurm.conf
#   deploy/slurm/local-cluster.sh stop DIR
#
# Needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge); nothing under /etc is changed.
set -euo pipefail

command=${1:?usage: local-cluster.sh start DIR CTLD_PORT SLURMD_PORT | stop DIR}
dir=$(realpath -m "${2:?the cluster folder}")

stop() {
    for name in slurmd slurmctld munged; do
        if [ -f "$dir/$name.pid" ]; then
            pid=$(cat "$dir/$name.pid")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
            rm -f "$dir/$name.pid"
        fi
    done
}

start() {
    local ctld_port=${1:?the slurmctld port} slurmd_port=${2:?the slurmd port}
    local host user cpus
    host=$(hostname -s)
    user=$(id -un)
    cpus=$(nproc)
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; }
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file "$dir/munge/munge.key" --socket "$dir/munge/munge.socket" \
        --pid-file "$dir/munged.pid" --log-file "$dir/munged.log" --seed-file "$dir/munge/munged.seed"

    # cred_expire: also how long a requeued job waits before it may start again (120 s by default)
    cat > "$dir/slurm.conf" <<EOF
ClusterName=imgcls-local
SlurmctldHost=$host
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
InactiveLimit=0
KillWait=30
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF" -i
    slurmd -f "$SLURM_CONF"
    # ready when the node takes jobs
    for _ in $(seq 300); do
        state=$(sinfo -h -N -o %T 2>/dev/null || true)
        case "$state" in idle*|mixed*|allocated*) echo "slurm: node $host $state (SLURM_CONF=$SLURM_CONF)"; return 0;; esac
        sleep 0.2
    done
    echo "slurm: the node did not come up (state '${state:-none}'); logs in $dir" >&2
    tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
    stop
    return 1
}

case "$command" in
    start) shift 2; start "$@" ;;
    stop) stop ;;
    *) echo "usage: local-cluster.sh start DIR CTLD_PORT SLURMD_PORT | stop DIR" >&2; exit 2 ;;
esac
