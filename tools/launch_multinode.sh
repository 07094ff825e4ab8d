#!/usr/bin/env bash
# Launch tools/train_ppo.py (or another script) on every node listed in a hostfile, through torchrun.
#
# Run this same command on each node (by hand, pdsh, or your scheduler's per-node step):
#
#   HOSTFILE=hosts.txt GPUS_PER_NODE=8 bash tools/launch_multinode.sh experiment=qwen2_5_32b_multinode ...
#
# hosts.txt lists one node per line (hostname or IP, optional "slots=N" ignored; '#' comments). The first line
# is the rendezvous host. This node's rank is NODE_RANK when set, else the line matching this host's name or one
# of its addresses. Everything after the script's options is passed to the training script as Hydra overrides.
#
# Environment:
#   HOSTFILE        path to the hostfile (required)
#   GPUS_PER_NODE   processes per node (default: number of GPUs, or 1 without GPUs)
#   MASTER_PORT     rendezvous port on the first host (default 29400)
#   NODE_RANK       this node's index in the hostfile (default: found by hostname / IP)
#   SCRIPT          training script (default tools/train_ppo.py)
#   RDZV_ID         job id shared by all nodes (default mcore_rl)
#   PYTHON          interpreter with the project installed (default: python on PATH, e.g. the activated .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
: "${HOSTFILE:?set HOSTFILE to a file listing one node per line}"
[ -f "$HOSTFILE" ] || { echo "hostfile $HOSTFILE does not exist" >&2; exit 2; }
mapfile -t HOSTS < <(sed -e 's/#.*//' -e 's/slots=[0-9]*//' -e 's/[[:space:]]*$//' -e '/^[[:space:]]*$/d' "$HOSTFILE" | awk '{print $1}')
NNODES=${#HOSTS[@]}
[ "$NNODES" -ge 1 ] || { echo "hostfile $HOSTFILE lists no hosts" >&2; exit 2; }
MASTER_ADDR=${HOSTS[0]}
MASTER_PORT=${MASTER_PORT:-29400}
if [ -z "${NODE_RANK:-}" ]; then
    names=" $(hostname) $(hostname -f 2>/dev/null || true) $(hostname -I 2>/dev/null || true) "
    for i in "${!HOSTS[@]}"; do
        if [[ "$names" == *" ${HOSTS[$i]} "* ]]; then NODE_RANK=$i; break; fi
    done
    [ -n "${NODE_RANK:-}" ] || { echo "this host ($(hostname)) is not in $HOSTFILE; set NODE_RANK" >&2; exit 2; }
fi
if [ -z "${GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
# Never let NCCL use NVLink multicast on shared hosts (see docs/multinode.md).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
echo "node $NODE_RANK of $NNODES, $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "${SCRIPT:-tools/train_ppo.py}" "$@"
