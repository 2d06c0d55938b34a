# Sourced by the serving device scripts (perf_serving_gpu.sh, perf_expert_parallel_gpu.sh): the
# calculator and one bench process, on $PACK with $IO, each row's JSON into $JSON.

# --measure: the engine's fixed part, confirmed by its start-up step (decision 043)
budget() { python3 -m pwctl.bench.serving_budget "$PACK" --device cuda "$@"; }
row() {  # a policy's JSON name: uniform:3 -> uniform3, pagedweight:2225602560B -> pagedweight
  case $1 in uniform:*) echo "${1/:/}" ;; *) echo "${1%%:*}" ;; esac
}
tp() {  # name, then bench arguments: one bench process (it starts any other ranks), its rc
  local name=$1
  shift
  timeout "${TP_TIMEOUT:-300}" pwctl bench "$PACK" --throughput --device cuda "${IO[@]}" "$@" \
    --json "$JSON/$name.json"
  echo "[$name] rc $?"
}
