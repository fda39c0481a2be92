"""The CPU price of a gRPC message: one stream per request against one stream for all of them.

    python -m pagedserve.bench.grpc_messages [--requests 48] [--steps 75] [--period-ms 15]
        [--reps 6]
    pagedserve bench grpc-messages ...

What a decode step's hand-over to the router costs in transport alone. A `grpc.aio` server in
its own process plays the decode worker: every `--period-ms` (a decode step) it sends each of
`--requests` streams one `DecodeResponse` (one token), as `Decode` does today; or it sends one
message per step holding every request's `DecodeResponse` (length-prefixed), as one stream per
router connection would. This process plays the router: it reads and parses every
`DecodeResponse`. Repetitions alternate the two ways; each reports the CPU time (user + system)
of both processes per `DecodeResponse`, median and min-max. Nothing of pagedserve runs but its
message type: the numbers bound what batching the hop could save, not what the router spends.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import struct
import subprocess
import sys
from collections.abc import Sequence

import grpc

from pagedserve.internal.v1 import decode_pb2

_SERVICE = "pagedserve.bench.Messages"
_LENGTH = struct.Struct("<I")


def _part(request: int, step: int) -> bytes:
    return decode_pb2.DecodeResponse(
        request_id=f"tenant-0/request-{request:06d}",
        token_ids=[1000 + step],
        num_generated=step + 2,
    ).SerializeToString()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve(requests: int, steps: int, period_s: float) -> None:
    """Stream handlers, a step clock (`Start` arms it), `Cpu`; prints the port, then serves."""
    steps_done: list[asyncio.Event] = []

    async def start(_request: bytes, _context) -> bytes:
        steps_done[:] = [asyncio.Event() for _ in range(steps)]

        async def clock() -> None:
            await asyncio.sleep(0.2)  # NOTE: every stream is open by then
            for done in steps_done:
                done.set()
                await asyncio.sleep(period_s)

        asyncio.get_running_loop().create_task(clock())
        return b""

    async def per_request(request: bytes, _context):
        index = int(request)
        for step, done in enumerate(list(steps_done)):
            await done.wait()
            yield _part(index, step)

    async def batched(_request: bytes, _context):
        for step, done in enumerate(list(steps_done)):
            await done.wait()
            parts = (_part(i, step) for i in range(requests))
            yield b"".join(_LENGTH.pack(len(p)) + p for p in parts)

    async def cpu(_request: bytes, _context) -> bytes:
        return str(_cpu_s()).encode()

    handlers = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Start": grpc.unary_unary_rpc_method_handler(start),
            "Cpu": grpc.unary_unary_rpc_method_handler(cpu),
            "PerRequest": grpc.unary_stream_rpc_method_handler(per_request),
            "Batched": grpc.unary_stream_rpc_method_handler(batched),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _measure(port: int, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """{way: [(server, client) CPU microseconds per DecodeResponse, per repetition]}."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        start = channel.unary_unary(f"/{_SERVICE}/Start")
        cpu = channel.unary_unary(f"/{_SERVICE}/Cpu")
        per_request = channel.unary_stream(f"/{_SERVICE}/PerRequest")
        batched = channel.unary_stream(f"/{_SERVICE}/Batched")

        async def one_stream_each() -> int:
            async def read(index: int) -> int:
                n = 0
                async for message in per_request(str(index).encode()):
                    decode_pb2.DecodeResponse.FromString(message)
                    n += 1
                return n

            return sum(await asyncio.gather(*(read(i) for i in range(args.requests))))

        async def one_stream() -> int:
            n = 0
            async for message in batched(b""):
                view, offset = memoryview(message), 0
                while offset < len(view):
                    (length,) = _LENGTH.unpack_from(view, offset)
                    offset += _LENGTH.size
                    decode_pb2.DecodeResponse.FromString(view[offset : offset + length])
                    offset += length
                    n += 1
            return n

        ways = {
            "one stream per request": one_stream_each,
            "one stream, a message per step": one_stream,
        }
        results: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for rep in range(args.reps):
            for way in ways if rep % 2 == 0 else reversed(ways):
                server_before, client_before = float(await cpu(b"")), _cpu_s()
                await start(b"")
                parts = await ways[way]()
                server_s = float(await cpu(b"")) - server_before
                client_s = _cpu_s() - client_before
                assert parts == args.requests * args.steps, (way, parts)
                results[way].append((server_s / parts * 1e6, client_s / parts * 1e6))
                server_us, client_us = results[way][-1]
                print(f"  rep {rep + 1}, {way}: server {server_us:.1f} us, client "
                      f"{client_us:.1f} us per DecodeResponse", flush=True)  # fmt: skip
    return results


def _cell(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(results: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.requests} requests x {args.steps} steps every {args.period_ms:g} ms, "
        f"{args.reps} repetitions; CPU microseconds per DecodeResponse, median (min-max)",
        "",
        "| way | server (decode worker) | client (router) | both |",
        "|---|---|---|---|",
    ]
    for way, reps in results.items():
        server, client = [r[0] for r in reps], [r[1] for r in reps]
        both = [s + c for s, c in reps]
        lines.append(f"| {way} | {_cell(server)} | {_cell(client)} | {_cell(both)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve bench grpc-messages", description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--steps", type=int, default=75)
    parser.add_argument("--period-ms", type=float, default=15.0)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.requests, args.steps, args.period_ms / 1e3))
        return 0
    command = [sys.executable, "-m", "pagedserve.bench.grpc_messages", "--serve",
               "--requests", str(args.requests), "--steps", str(args.steps),
               "--period-ms", str(args.period_ms)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            print(report(asyncio.run(_measure(port, args)), args))
        finally:
            server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
