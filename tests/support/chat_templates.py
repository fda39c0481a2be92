"""Chat templates for tests, and a tiny model directory that carries one.

CHATML follows the shape of SmolLM2-Instruct's template (ChatML turns, a default system turn
when the conversation has none); STRICT is a Llama-2-like template written with one tag per line
(so trim_blocks/lstrip_blocks matter), with `bos_token`, `eos_token`, a default system prompt, a
`{% generation %}` block and `raise_exception` for roles it does not know; TOOLKIT uses
`namespace`, `{% continue %}` and `tojson`; HERMES shows tools and tool calls as Qwen2.5 does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

STRICT = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set turns = messages[1:] %}
{% else %}
    {% set system = 'You are a terse assistant.' %}
    {% set turns = messages %}
{% endif %}
[SYS] {{ system }}
{% for message in turns %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Roles must be user or assistant, got ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'user' %}
[USER] {{ message['content'] | trim }}
    {% else %}
{% generation %}[BOT] {{ message['content'] }}{{ eos_token }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[BOT]
{% endif %}
"""

TOOLKIT = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}"
    "{% if m.content == '' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)

HERMES = (  # Qwen2.5's way with tools, cut down: tools in the system turn, calls as <tool_call>
    "{%- if tools %}<|im_start|>system\nYou may call:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def model_with_template(
    base: Path, out: Path, template: str | None, *, as_jinja_file: bool = False
) -> Path:
    """A copy of model dir `base` in `out` whose tokenizer carries `template` (in
    tokenizer_config.json, or in chat_template.jinja with `as_jinja_file`, leaving the config's
    template as it was); None: no template at all."""
    shutil.copytree(base, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template is None:
        config.pop("chat_template", None)
    elif not as_jinja_file:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2))
    if template is not None and as_jinja_file:
        (out / "chat_template.jinja").write_text(template)
    return out
