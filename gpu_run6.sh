rm -rf /tmp/site; source .gpu/prelude.sh
export TOKENIZER=$PWD/.gpu/tok ECHO_CACHE=$PWD/.gpu/echo-cache
P=tools/dev/probe_persistent_decode.py
timeout 90 python3 $P --model qwen3-0.6b --layers 1 --phases --context 16 2>&1 | tail -6
timeout 150 python3 $P --model qwen3-0.6b 2>&1 | tail -9
timeout 120 python3 tools/bench_latency.py --model qwen3-0.6b --max-model-len 2048 --iters 2 --num-scheduler-steps 8 --persistent-decode 2>&1 | grep decode | tail -1
