"""`router.chatTemplate`: the text of the routers' `--chat-template FILE`, held in a ConfigMap,
mounted read-only where the flag points, rolled by a checksum; the template the router reads is
the operator's file byte for byte and compiles. Unset: no flag, no ConfigMap."""

from __future__ import annotations

from chart import (
    CHAT_TEMPLATE,
    LINUX_AMD64_ONLY,
    RELEASE,
    Doc,
    container,
    deployment,
    flag,
    mounted_file,
    of_kind,
)

from pagedserve.router.chat import ChatTemplate

pytestmark = LINUX_AMD64_ONLY

CONFIG_MAP = f"{RELEASE}-pagedserve-router-chat-template"


def test_the_template_reaches_every_router_as_the_flags_file(
    renders: dict[str, list[Doc]],
) -> None:
    docs = renders["production"]
    box = container(docs, "router")
    path = flag(box["args"], "--chat-template")
    assert path == "/etc/pagedserve/chat-template/chat_template.jinja"
    pod = deployment(docs, "router")["spec"]["template"]
    assert mounted_file(pod["spec"], box, path) == ("configMap", CONFIG_MAP, "chat_template.jinja")
    (config,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == CONFIG_MAP]
    source = config["data"]["chat_template.jinja"]
    assert source == CHAT_TEMPLATE.read_text()
    assert ChatTemplate(source).available
    # NOTE: the routers read it at start: a changed template must roll them
    assert len(pod["metadata"]["annotations"]["checksum/chat-template"]) == 64
    # beside the API keys' mount, not instead of it
    assert flag(box["args"], "--api-key-file")
    for role in ("prefill", "decode", "gateway"):
        assert "--chat-template" not in container(docs, role)["args"], role


def test_without_a_template_the_routers_use_the_models(renders: dict[str, list[Doc]]) -> None:
    for case in ("defaults", "tls-secret-fetch-model"):
        docs = renders[case]
        assert "--chat-template" not in container(docs, "router")["args"]
        assert not [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == CONFIG_MAP]
        pod = deployment(docs, "router")["spec"]["template"]
        assert "checksum/chat-template" not in (pod["metadata"].get("annotations") or {})
        assert all(v["name"] != "chat-template" for v in pod["spec"]["volumes"])
