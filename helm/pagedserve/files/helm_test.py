# `helm test`: the router answers SERVING for pagedserve.v1.Generation (grpc.health.v1), then
# `pagedserve generate ARGS...` runs one short generation through it, as a client would (TLS
# and API key included). ARGS are `pagedserve generate`'s own flags and prompt; an API key is
# read from $PAGEDSERVE_API_KEY_FILE (the router's tenant:key file: its first key).
import os
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.grpcutil import client_tls_from_files, make_channel

args = sys.argv[1:]


def flag(name):
    return args[args.index(name) + 1] if name in args else None


tls = client_tls_from_files(
    flag("--tls-ca"),
    flag("--tls-client-cert"),
    flag("--tls-client-key"),
    flag("--tls-server-name"),
)
request = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
try:
    with make_channel(flag("--router"), tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
except grpc.RpcError as err:
    sys.exit(f"router health: {err.code().name}: {err.details()}")
status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
print(f"router health: {status}", flush=True)
if status != "SERVING":
    sys.exit(1)
env = dict(os.environ)
key_file = env.pop("PAGEDSERVE_API_KEY_FILE", "")
if key_file:
    with open(key_file) as keys:
        lines = [line.strip() for line in keys if line.strip() and not line.startswith("#")]
    env["PAGEDSERVE_API_KEY"] = lines[0].split(":", 1)[1].strip()
sys.exit(subprocess.call(["pagedserve", "generate", *args], env=env))
