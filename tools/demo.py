"""The README's demo: start `echollm serve` on the embedded default model, ask it one chat
question through the OpenAI API, print the answer, stop the server (by its PID)."""

import json
import signal
import subprocess
import sys
import time

import httpx

PORT = 8765
QUESTION = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"


def main() -> int:
    server = subprocess.Popen([sys.executable, "-m", "echo", "serve", "--port", str(PORT),
                               "--max-model-len", "2048", "--log-level", "warning"])
    base = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                print("the server exited during start-up", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                print("the server did not become healthy", file=sys.stderr)
                return 1
            time.sleep(0.5)
        body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 64, "temperature": 0}
        print(f"POST {base}/v1/chat/completions\n{json.dumps(body)}")
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
        print(f"\n> {QUESTION}\n{reply['choices'][0]['message']['content']}\n")
        print(f"usage: {reply['usage']}")
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
