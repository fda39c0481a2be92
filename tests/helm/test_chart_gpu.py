"""GPUs: only workers ask for them, the GPU preset runs CUDA workers on a CUDA image, and the
tensor-parallel size sets a role's GPU count."""

from __future__ import annotations

import argparse

import yaml
from chart import (
    CHART,
    LINUX_AMD64_ONLY,
    MATRIX,
    Doc,
    Tools,
    _set,
    container,
    deployment,
    expand,
    flag,
    helm_template,
    render,
    without_pending_flags,
)

from pagedserve.cli import build_parser

pytestmark = LINUX_AMD64_ONLY


def test_gpu_goes_to_workers_only(renders: dict[str, list[Doc]]) -> None:
    docs = renders["gpu"]
    for role in ("prefill", "decode"):
        box = container(docs, role)
        assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert box["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert flag(box["args"], "--device") == "cuda"
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
    strategy = deployment(docs, "decode")["spec"]["strategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    router = container(docs, "router")
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})
    assert "--device" not in router["args"]
    for role in ("prefill", "decode"):
        box = container(renders["defaults"], role)
        assert flag(box["args"], "--device") == "cpu"
        assert "nvidia.com/gpu" not in box["resources"]["limits"]


def test_gpu_preset_runs_cuda_workers_on_a_cuda_image(
    tools: Tools, renders: dict[str, list[Doc]]
) -> None:
    preset = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert preset["image"]["tag"] == f"{chart['appVersion']}-cu128"  # the Dockerfile's CUDA tag
    docs = renders["production"]
    for role in ("prefill", "decode"):
        box = container(docs, role)
        assert box["image"].endswith(f":{preset['image']['tag']}")
        assert flag(box["args"], "--device") == "cuda"
        fraction = flag(box["args"], "--kv-cache-memory-fraction")
        assert fraction == str(preset[role]["kvCacheMemoryFraction"]) == "0.9"
        assert "--kv-cache-memory" not in box["args"]  # the fraction replaces the size
        assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert flag(container(docs, "decode")["args"], "--swap-space") == "16"
    # the default tag is the CPU build: --device cuda on it is refused, --device cpu is the default
    result = helm_template(tools.helm4, _set("gpu.enabled=true"))
    assert result.returncode != 0 and "CUDA build" in result.stderr
    for role in ("prefill", "decode"):
        assert flag(container(renders["defaults"], role)["args"], "--device") == "cpu"


def test_tensor_parallel_size_reaches_its_role_and_its_gpu_count(
    renders: dict[str, list[Doc]], tools: Tools
) -> None:
    """`tensorParallelSize` is per worker role: `--tensor-parallel-size N` (parsed by the real
    CLI) and, with GPUs, one GPU per rank in place of `gpu.count`; the router gets neither.
    Unset (1), no flag is rendered and the pod keeps `gpu.count`."""

    def parsed(docs: list[Doc], role: str) -> argparse.Namespace:
        return build_parser().parse_args(
            expand(without_pending_flags(role, container(docs, role)["args"]))
        )

    def gpus(docs: list[Doc], role: str) -> tuple[int | None, int | None]:
        resources = container(docs, role)["resources"]
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        return limits.get("nvidia.com/gpu"), requests.get("nvidia.com/gpu")

    for role in ("prefill", "decode"):
        assert "--tensor-parallel-size" not in container(renders["gpu"], role)["args"]
        assert parsed(renders["gpu"], role).tensor_parallel_size == 1
        assert gpus(renders["gpu"], role) == (1, 1)
    docs = renders["tensor-parallel-gpu"]
    for role in ("prefill", "decode"):
        assert flag(container(docs, role)["args"], "--tensor-parallel-size") == "2", role
        assert parsed(docs, role).tensor_parallel_size == 2, role
        assert gpus(docs, role) == (2, 2), role
    assert "--tensor-parallel-size" not in container(docs, "router")["args"]
    assert gpus(docs, "router") == (None, None)
    # per role: decode alone, over a gpu.count of 3 that prefill keeps
    docs = render(
        tools.helm4, [*MATRIX["gpu"], *_set("gpu.count=3", "decode.tensorParallelSize=4")]
    )
    assert (parsed(docs, "decode").tensor_parallel_size, gpus(docs, "decode")) == (4, (4, 4))
    assert (parsed(docs, "prefill").tensor_parallel_size, gpus(docs, "prefill")) == (1, (3, 3))
    # on CPU (gloo ranks): the flag, and no GPU anywhere
    docs = render(tools.helm4, _set("prefill.tensorParallelSize=2", "decode.tensorParallelSize=2"))
    for role in ("prefill", "decode"):
        assert flag(container(docs, role)["args"], "--tensor-parallel-size") == "2", role
        assert gpus(docs, role) == (None, None), role


GPU_NODES = {"nvidia.com/gpu.present": "true"}


def test_gpu_preset_pins_workers_to_gpu_nodes_only(
    tools: Tools, renders: dict[str, list[Doc]]
) -> None:
    """gpu.enabled (and values-gpu.yaml, in the production case): prefill and decode pods select
    GPU nodes, tolerate their taint and ask for a GPU; router, gateway, Redis and the test pod
    do none of that (they would hold a GPU node for nothing)."""
    for case in ("gpu", "production"):
        docs = renders[case]
        for role in ("prefill", "decode"):
            pod = deployment(docs, role)["spec"]["template"]["spec"]
            assert pod["nodeSelector"] == GPU_NODES, (case, role)
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
                "tolerations"
            ]
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        pods = [
            d["spec"]["template"]["spec"]
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and not d["metadata"]["name"].endswith(("prefill", "decode"))
        ]
        pods += [d["spec"] for d in docs if d["kind"] == "Pod"]
        assert len(pods) >= 3, case
        for pod in pods:
            assert "nodeSelector" not in pod and "tolerations" not in pod
            for box in pod["containers"]:
                assert "nvidia.com/gpu" not in box.get("resources", {}).get("limits", {})
    for role in ("prefill", "decode"):  # CPU default: no GPU node needed
        assert (
            "nodeSelector" not in deployment(renders["defaults"], role)["spec"]["template"]["spec"]
        )
    # a role's own nodeSelector is kept, and wins on a shared key
    docs = render(
        tools.helm4,
        [
            *MATRIX["gpu"],
            *_set("decode.nodeSelector.pool=a100"),
            "--set-string",
            r"decode.nodeSelector.nvidia\.com/gpu\.present=false",
        ],
    )
    pod = deployment(docs, "decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a100", "nvidia.com/gpu.present": "false"}
