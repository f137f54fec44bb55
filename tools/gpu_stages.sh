# Sourced by tools/gpu_acceptance.sh and tools/dev/gpu_probes.sh, from the repository root: runs
# each stage named on the command line through the caller's `stage_commands STAGE DIR`, in a
# scratch folder DIR that is then packed into $OUT/STAGE.tar.gz (the device tool returns few
# files).
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
# what tools/dev/gpu_carry_files.sh put under .gpu (carried): the embedded model's tokenizer,
# for the GPU tests that need it (structured outputs) and the stages that take --tokenizer
if [ -d .gpu/echo-cache ] && [ -d .gpu/tok ]; then
  export ECHO_CACHE=${ECHO_CACHE:-$PWD/.gpu/echo-cache} TOKENIZER=${TOKENIZER:-$PWD/.gpu/tok}
fi

run_stages() {
  local stage dir
  for stage in "$@"; do
    echo "=== $stage"
    dir=$(mktemp -d)
    stage_commands "$stage" "$dir"
    if [ $? -eq 2 ]; then rm -rf "$dir"; continue; fi  # an unknown stage: nothing to pack
    tar -czf "$OUT/$stage.tar.gz" -C "$dir" .
    rm -rf "$dir"
  done
}
