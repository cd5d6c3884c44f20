"""Chat templates written for rlfabric's built-in models, in the Jinja dialect of Hugging Face
chat templates (`tokenizer_config.json` `chat_template`).

- `CHATML_TOOLS`: ChatML with Qwen2.5's tool format: tools listed in the system turn,
  calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as
  `<tool_response>` blocks in a user turn. Append-only: a conversation's rendering is a prefix
  of the rendering of any conversation that extends it.
- `CHATML_THINK`: the same, with Qwen3's handling of reasoning: an assistant turn's
  `<think>...</think>` is kept only after the last user message, and with
  `enable_thinking=False` the generation prompt carries an empty think block that no history
  turn keeps. Not append-only, on purpose: what a gateway must notice.
"""

from __future__ import annotations

_SYSTEM_AND_TOOLS = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
"""

_TOOL_CALLS = """\
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
"""

_TOOL_RESULT = """\
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
"""

CHATML_TOOLS = _SYSTEM_AND_TOOLS + """\
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ('user', 'system')
            or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
""" + _TOOL_CALLS + """\
        {{- '<|im_end|>\\n' }}
""" + _TOOL_RESULT + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHATML_THINK = _SYSTEM_AND_TOOLS + """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ('user', 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- if loop.index0 > ns.last_query %}
                {%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
""" + _TOOL_CALLS + """\
        {{- '<|im_end|>\\n' }}
""" + _TOOL_RESULT + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

#: the templates by the name a `ModelSpec.chat_template` gives
#: `tinychat`'s: ChatML's markers with a one-letter role (u, s, a, t), a tool call as the one
#: token `<tool_call>` (the calculator of `rlfabric up --task tools`; tools are not listed).
#: Append-only.
TINYCHAT = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>a' + (message.content or '') }}
        {%- for tool_call in message.tool_calls or [] %}
            {{- '<tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
    {%- else %}
        {{- '<|im_start|>' + message.role[0] + (message.content or '') + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>a' }}
{%- endif %}
"""
TEMPLATES: dict[str, str] = {"chatml-tools": CHATML_TOOLS, "chatml-think": CHATML_THINK,
                             "tinychat": TINYCHAT}
