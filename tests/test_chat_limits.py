"""Issue 31 item 4: a chat template cannot build a huge value, whatever builds it. Each way a
template makes text is sized before it allocates, so a hostile template fails fast, with little
memory and the server's `template_error`; ordinary templates render exactly as jinja2's sandbox
renders them."""

import time
import tracemalloc

import pytest
from test_serve_server import VOCAB, ask, make_server

from strata_cli.serve.chat import TEMPLATE_MAX_CHARS, ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "abc"}]
S = "{% set s = 'x' * 10000000 %}"  # 10 M characters: allowed, and the seed of most attacks

ATTACKS = [
    # the three
    "{{ '%1000000000s'|format('x') }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ '{:>1000000000}'.format('x') }}",
    # str.format and format_map: widths, precisions, nested specs, conversions, repeated fields
    "{{ '{0:{1}}'.format('x', '1000000000') }}",
    "{{ '{:.1000000000f}'.format(1.0) }}",
    "{{ '{a:>1000000000}'.format_map({'a': 'x'}) }}",
    S + "{{ '{0}{0}{0}'.format(s) }}",
    S + "{{ '{0!r}'.format([s] * 1000) }}",
    # printf-style %
    "{{ '%.1000000000f' % 1.0 }}",
    "{{ '%*s' % (1000000000, 'x') }}",
    "{{ '%(a)1000000000s' % {'a': 'x'} }}",
    S + "{{ '%s%s%s' % (s, s, s) }}",
    # str methods
    "{{ 'x'.rjust(1000000000) }}",
    "{{ 'x'.zfill(1000000000) }}",
    "{{ ('\t' * 1000).expandtabs(16000000) }}",
    S + "{{ s.replace('', s) }}",
    S + "{{ ''.join([s] * 1000) }}",
    "{{ ('x' * 1000).translate({120: 'y' * 1000000}) }}",
    "{% set s = 'ß' * 10000000 %}{{ s.upper() }}",
    "{{ ('x ' * 8000000).split()|length }}",  # 8 M new string objects: 400 MB
    "{{ ('中' * 16000000)|list|length }}",
    # filters
    S + "{{ s|replace('x', s) }}",
    S + "{{ ([s] * 1000)|join }}",
    S + "{{ ([s] * 1000)|string }}",
    S + "{{ ([s] * 1000)|tojson }}",
    S + "{{ ([s] * 1000)|pprint }}",
    "{% set s = 'a\n' * 5000000 %}{{ s|indent(1000) }}",
    "{% set s = 'a ' * 5000000 %}{{ s|wordwrap(1, wrapstring='x' * 1000) }}",
    "{% set s = 'ß' * 10000000 %}{{ s|upper }}",
    "{% set s = '<' * 5000000 %}{{ s|e }}",
    "{{ ('a.co ' * 3000000)|urlize }}",
    "{{ [1]|batch(1000000000, 'x')|list }}",
    S + "{{ {'a': s, 'b': s}|xmlattr }}",
    S + "{{ {'a': s, 'b': s}|urlencode }}",
    # ~, printing a list, captured blocks, globals
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    S + "{{ s ~ s }}",
    S + "{{ [s] * 1000 }}",
    S + "{{ {'a': [s] * 1000} }}",
    "{% autoescape true %}{% set s = '<' * 5000000 %}{{ s }}{% endautoescape %}",
    S + "{% set x %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endset %}{{ x|length }}",
    S + "{% macro m() %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}",
    S + "{% filter length %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endfilter %}",
    "{{ lipsum(1000000) }}",
    "{{ strftime_now('%c' * 1000000) }}",
    # many values, each allowed: the render's total
    "{{ range(100000)|map('center', 16000000)|list|length }}",
    "{{ ([[1] * 100000] * 1000)|sum(start=[]) }}",
]


def render_measured(source, **kwargs):
    """(error, seconds, peak bytes) of compiling and rendering `source`."""
    tracemalloc.start()
    started = time.process_time()  # CPU, not wall: a loaded CI host must not fail a fast refusal
    try:
        with pytest.raises(ChatTemplateError) as error:
            ChatTemplate(source, {}).render(MESSAGES, **kwargs)
        return error.value, time.process_time() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("source", ATTACKS)
def test_a_template_that_would_build_a_huge_value_fails_fast_and_small(source):
    error, seconds, peak = render_measured(source)
    assert error.code == "template_error"
    assert "would build a value" in str(error) or "in all" in str(error), error
    assert seconds < 1.0, (seconds, error)  # building the value would take minutes and gigabytes
    # the template's own 10 M-character seed, and for the last two the render's total budget
    assert peak < (200 << 20 if "map(" in source or "sum(" in source else 40 << 20), (peak, error)


def test_loading_a_template_runs_none_of_its_code():
    started = time.monotonic()
    ChatTemplate("{{ 'x'|center(1000000000) }}{% set y = '%1000000000s'|format('x') %}", {})
    assert time.monotonic() - started < 0.5  # jinja2 folds constant expressions while compiling
    with pytest.raises(ValueError, match="does not compile.*would build a value"):
        ChatTemplate("{% autoescape ('x'|center(1000000000)) == 'y' %}{% endautoescape %}", {})


def test_values_up_to_the_limit_are_still_built():
    half = TEMPLATE_MAX_CHARS // 2
    assert len(ChatTemplate(f"{{{{ 'x'|center({half}) }}}}", {}).render(MESSAGES)) == half
    assert len(ChatTemplate(f"{{{{ '%{half}s'|format('x') }}}}", {}).render(MESSAGES)) == half
    assert len(ChatTemplate(f"{{{{ '{{:>{half}}}'.format('x') }}}}", {}).render(MESSAGES)) == half
    assert len(ChatTemplate(f"{{% set s = 'x' * {half} %}}{{{{ s ~ s }}}}", {}).render(MESSAGES)) == 2 * half


@pytest.fixture(scope="module")
def loop_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=VOCAB), seed=0)


@pytest.mark.parametrize("source", ATTACKS[:3])
def test_the_server_answers_template_error_at_once_and_keeps_serving(loop_model, source):
    server, out = make_server(loop_model)
    server.chat = ChatTemplate(source, {})
    started = time.monotonic()
    reply = ask(server, out, id=1, messages=MESSAGES)
    assert reply["error"]["code"] == "template_error" and time.monotonic() - started < 0.5
    assert ask(server, out, id=2, prompt="abcabc", max_tokens=2)["done"]


# -- ordinary templates render as jinja2's own sandbox renders them ------------------------------

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set tool_call = tool_call.function or tool_call %}
            {{- '\n<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' ~ content ~ '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

LLAMA3 = r"""{{- bos_token }}
{%- set date_string = "26 Jul 2024" %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

MISTRAL = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"""

GEMMA = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

KITCHEN_SINK = r"""{% macro box(title) %}[{{ title|center(12) }}|{{ caller() }}]{% endmacro %}
{% set joined %}{% for m in messages %}{{ loop.index }}:{{ m.role|upper }}{{ loop.cycle(';', ',') }}{% endfor %}{% endset %}
{{ joined }} {{ joined|length }}
{% call box('t') %}{{ messages|map(attribute='role')|join('/') }}{% endcall %}
{{ '%-8s|%+d|%05.1f|%x|%c|%%|%r' % ('ab', 5, 3.14159, 255, 65, 'q') }} {{ '%(a)s=%(b)3d' % {'a': 'k', 'b': 7} }}
{{ '%s and %s'|format('x', 2) }} {{ '%(n)s!'|format(n='kw') }} {{ '%s' % [1, 'a', none] }}
{{ '{:>6}|{:<4}|{:^7.2f}|{:,}|{!r}'.format('a', 'b', 2.5, 1234567, 'r') }} {{ '{x[0]}-{y.role}'.format(x=[9], y=messages[0]) }}
{{ '{k}'.format_map({'k': 'map'}) }} {{ 'ab'.center(6, '*') }} {{ 'ab'.ljust(4, '.') }}|{{ 'ab'.rjust(4) }}|{{ '7'.zfill(3) }}
{{ 'a\tb'.expandtabs(4) }} {{ 'abc'.translate({97: 'AA', 98: none}) }} {{ 'a-b-c'.replace('-', '+', 1) }} {{ 'x'.join(['1', '2', '3']) }}
{{ 'Straße'.upper() }} {{ 'ÉCOLE'.lower() }} {{ 'straße'|upper }} {{ 'hello world'|title }} {{ 'abc'|capitalize }}
{{ "line one\nline two"|indent(2, true) }} {{ "a\n\nb"|indent('> ', blank=true) }}
{{ "the quick brown fox jumps over the lazy dog"|wordwrap(10) }} {{ 'a-b c'|wordwrap(3, wrapstring='|') }}
{{ "a long sentence to cut short here"|truncate(16) }} {{ 'x'|truncate(16, end='!') }}
{{ 'aXbXc'|replace('X', '__') }} {{ 'abc'|replace('', '.') }} {{ [1, 2, 3]|join(', ') }} {{ [1, 'b']|join }}
{{ {'b': 1, 'a': [1, 2]}|pprint }} {{ {'b': 1, 'a': [1, 2]}|tojson }} {{ {'b': '<&>', 'a': "é'"}|tojson(indent=2) }}
{{ [1, 'a', none, 1.5, true]|string }} {{ [1, 'a', none, 1.5, true] }} {{ messages[0] }} {{ (1, 'two') }} {{ {'k': {'n': [1]}} }}
{{ [[1], [2, 3]]|sum(start=[]) }} {{ [1, 2, 3]|sum }} {{ range(7)|batch(3, 0)|list }} {{ range(7)|slice(3)|list }}
{{ {'b': 2, 'a': 1}|dictsort }} {{ [3, 1, 2]|sort|list }} {{ [1, 1, 2]|unique|list }} {{ 'abc'|list }} {{ 'abc'|reverse }}
{{ {'class': 'x', 'id': 'y<'}|xmlattr }} {{ {'a': 'b c', 'd': 'é'}|urlencode }} {{ 'a b'|urlencode }} {{ 'see https://example.com now'|urlize }}
{{ '<b>&</b>'|e }} {{ '<b>x</b> y'|striptags }} {{ 'one two'|wordcount }} {{ 'x'|safe }} {{ 42|string }} {{ 3.0|int }} {{ '4'|float }}
{{ 5 % 3 }} {{ 2 ** 10 }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ 'a' ~ 1 ~ none ~ [2] }} {{ 7 // 2 }} {{ -3 }}
{{ none }}|{{ undefined_variable }}|{{ messages|length }}|{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y')|length }}
{% set j = joiner(', ') %}{% for x in 'abc' %}{{ j() }}{{ x }}{% endfor %} {% set c = cycler('x', 'y') %}{{ c.next() }}{{ c.next() }}{{ c.next() }}
{% filter upper %}filtered {{ 'block' }}{% endfilter %} {% autoescape true %}{{ '<i>' }}{{ '<b>' ~ 'x' }}{{ '<a>'|safe }}{{ '%s' % '<' }}{% endautoescape %}
{% for m in messages if m.role != 'system' %}{% if loop.first %}first{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}<{{ m.role }}:{{ m.content|trim }}>{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CHAT = [
    {"role": "system", "content": "You are helpful. <b>&</b>"},
    {"role": "user", "content": "  Hi — what's 2+2? "},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4",
     "tool_calls": [{"function": {"name": "calc", "arguments": {"x": [1, 2], "op": "é+"}}}]},
    {"role": "tool", "content": "4"},
    {"role": "user", "content": "Thanks\n\tbye"},
]
ALTERNATING = [m for m in CHAT if m["role"] in ("user", "assistant")][:3]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "required": ["x"]}}}]


def sandbox_render(source, messages, **variables):
    """The same template through jinja2's own sandbox, as chat.py configures it but unbounded."""
    import datetime

    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **variables)


@pytest.mark.parametrize("source, messages, variables", [
    (QWEN3, CHAT, {}),
    (QWEN3, CHAT, {"tools": TOOLS}),
    (LLAMA3, CHAT, {"tools": TOOLS, "bos_token": "<s>"}),
    (MISTRAL, ALTERNATING, {"bos_token": "<s>", "eos_token": "</s>"}),
    (GEMMA, CHAT, {"bos_token": "<bos>"}),
    (KITCHEN_SINK, CHAT, {"bos_token": "<s>", "eos_token": "</s>"}),
], ids=["qwen3", "qwen3-tools", "llama3", "mistral", "gemma", "kitchen-sink"])
def test_ordinary_templates_render_as_the_plain_sandbox_does(source, messages, variables):
    template = ChatTemplate(source, variables)  # the special tokens' slot takes `tools` as well
    expected = sandbox_render(source, messages, **variables)
    assert template.render(messages) == expected
    assert len(expected) > 80


def test_a_template_error_reads_as_before():
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ChatTemplate(MISTRAL, {}).render(CHAT)
    with pytest.raises(ChatTemplateError, match="rejected the messages") as error:
        ChatTemplate("{{ '%d' % 'x' }}", {}).render(MESSAGES)
    assert error.value.code == "template_error"
