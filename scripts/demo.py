"""`make demo`: a whole pagedserve cluster on this machine serving a real instruct model
(SmolLM2-135M-Instruct, from `pagedserve fetch-model`), two chat questions that share a system
prompt (the second reports cached prompt tokens), the same conversation through the
OpenAI-compatible HTTP gateway (`--http-port`), the cluster view, then a clean stop. The router
renders the messages with the model's own chat template (`GenerateRequest.messages`).

Exits non-zero if any step fails, so `make test` can run it as a smoke test of the real thing.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request

SYSTEM = (
    "You are a concise assistant for a bakery. Answer in one or two short sentences, and mention "
    "the oven temperature when it matters."
)
QUESTIONS = ("How long do croissants bake?", "What makes bread crust crisp?")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".cache/smollm2-135m-instruct")
    parser.add_argument("--max-tokens", default="64")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "pagedserve.cli"]
    print("$ pagedserve up --model", args.model, "--port 0 --http-port 0", flush=True)
    up = subprocess.Popen(
        [
            *cli,
            "up",
            "--model",
            args.model,
            "--port",
            "0",
            "--http-port",
            "0",
            "--kv-cache-memory",
            "64MiB",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address, http = None, None
        deadline = time.monotonic() + 150
        while address is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                print("pagedserve up exited before it was ready", file=sys.stderr)
                return 1
            print(line, end="", flush=True)
            if line.strip().startswith("OpenAI API"):
                http = line.split()[-1]
            if line.startswith("READY router"):
                address = line.split()[2]
        if address is None or http is None:
            return 1
        print(f"\nsystem: {SYSTEM}", flush=True)
        for question in QUESTIONS:
            print(f"\nuser: {question}", flush=True)
            print(f"$ pagedserve generate --router {address} --system '...' --chat '{question}'")
            chat = ["--system", SYSTEM, "--chat", question]
            generate = [*cli, "generate", "--router", address, *chat]
            if subprocess.run([*generate, "--max-tokens", args.max_tokens], timeout=120).returncode:
                return 1
        if not openai_chat(http, args.model, QUESTIONS[0], int(args.max_tokens)):
            return 1
        print(f"\n$ pagedserve status --router {address}", flush=True)
        if subprocess.run([*cli, "status", "--router", address], timeout=30).returncode:
            return 1
        return 0
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
        print(f"\npagedserve up stopped (exit {code})", flush=True)


def openai_chat(base_url: str, model_dir: str, question: str, max_tokens: int) -> bool:
    """The first question again, as any OpenAI client would ask it."""
    model = model_dir.rstrip("/").rsplit("/", 1)[-1]
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }  # fmt: skip
    print(f'\n$ curl {base_url}/chat/completions -d \'{{"model": "{model}", ...}}\'')
    request = urllib.request.Request(
        f"{base_url}/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    print(f"assistant: {answer['choices'][0]['message']['content']}")
    usage = answer["usage"]
    print(f"  usage: {usage['prompt_tokens']} prompt tokens "
          f"({usage['prompt_tokens_details']['cached_tokens']} cached), "
          f"{usage['completion_tokens']} completion tokens", flush=True)  # fmt: skip
    return bool(answer["choices"][0]["message"]["content"])


if __name__ == "__main__":
    sys.exit(main())
