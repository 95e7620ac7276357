"""Chat templates: a conversation rendered to text as Hugging Face transformers renders it,
encoded to ids, and which of those ids the assistant wrote (the tokens the loss scores).

The template is the tokenizer's own (its `chat_template.jinja`, else the `chat_template` of
its tokenizer_config.json), `data.chat_template=chatml` (the built-in CHATML below), or a
.jinja file named by `data.chat_template`. It runs in the environment transformers gives
chat templates (`apply_chat_template`): jinja2's immutable sandbox with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block, a `tojson` filter
that is `json.dumps` (no HTML escaping, non-ASCII kept), `raise_exception(message)`,
`strftime_now(format)`, and the variables `messages`, `add_generation_prompt`, `tools` and
`documents` (None) and the tokenizer's special tokens (`bos_token`, `eos_token`, ...). The
rendered text is encoded whole, with no special tokens added: the ids equal
`AutoTokenizer.apply_chat_template(messages)`.

The assistant's tokens are those whose characters overlap a span the assistant wrote:
- a template with `{% generation %}` blocks marks the spans itself (transformers'
  `return_assistant_tokens_mask`);
- otherwise assistant turn i spans from the end of its generation prompt (the conversation
  before it rendered with `add_generation_prompt`, which must begin the whole rendering) to
  the end of the turn's closing text, the stop text the template writes after an assistant
  message (`<|im_end|>`, `<|eot_id|>`), learned once per template from a probe conversation,
  trailing whitespace excluded. So the targets are the turn's content and its stop token;
  anything the template writes between the generation prompt and the content (Qwen3's empty
  `<think>` block on the last turn) is the assistant's too.
"""

import functools
import json
import re
from datetime import datetime

import numpy as np

from jaxmoe.compat.optional import require

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}
ROLES = ("system", "user", "assistant", "tool")
_PROBE_ANSWER = "jaxmoe probe answer"
_PROBE = [{"role": "user", "content": "jaxmoe probe question"},
          {"role": "assistant", "content": _PROBE_ANSWER}]  # fmt: skip


def _raise_exception(message):
    jinja2 = require("jinja2", "chat templates")
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_text: str) -> str:
    return datetime.now().strftime(format_text)


@functools.cache
def _generation_extension():
    """A jinja2 extension for `{% generation %}...{% endgeneration %}`: the block renders its
    body, and while spans are being recorded its [start, end) characters in the output."""
    jinja2 = require("jinja2", "chat templates")
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        @jinja2.pass_context
        def _block(self, context, caller):
            text = caller()
            recorder = context.environment.recorder
            if recorder is not None:
                start = sum(len(piece) for piece in recorder["pieces"])
                recorder["spans"].append((start, start + len(text)))
            return text

    return Generation


@functools.cache
def compile_template(source: str):
    """The jinja2 template of `source`, in transformers' chat-template environment."""
    jinja2 = require("jinja2", "chat templates")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"],
    )
    env.recorder = None  # set while a rendering records {% generation %} spans
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=jinja2.utils.Namespace,
    )
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template, line {error.lineno}: {error.message}") from None


def has_generation_blocks(source: str) -> bool:
    """Whether the template marks the assistant's text with {% generation %} blocks."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


class ChatTemplate:
    """One tokenizer's chat template: `encode(messages)` -> (ids, assistant mask)."""

    def __init__(self, source: str, tokenizer):
        self.source, self.tokenizer = source, tokenizer
        self.template = compile_template(source)
        self.special_tokens = dict(getattr(tokenizer, "special_tokens", {}))
        self.marked = has_generation_blocks(source)
        self._stop_text = None if self.marked else self._learn_stop_text()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        jinja2 = require("jinja2", "chat templates")
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template: {error}") from None

    def _render_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and its {% generation %} spans."""
        env = self.template.environment
        pieces: list[str] = []
        env.recorder = {"pieces": pieces, "spans": []}
        try:
            for piece in self.template.generate(
                messages=messages,
                add_generation_prompt=False,
                tools=None,
                documents=None,
                **self.special_tokens,
            ):
                pieces.append(piece)
            return "".join(pieces), env.recorder["spans"]
        finally:
            env.recorder = None

    def _learn_stop_text(self) -> str:
        """The text the template closes an assistant turn with (e.g. `<|im_end|>`)."""
        prompt = self.render(_PROBE[:1], add_generation_prompt=True)
        whole = self.render(_PROBE)
        end = whole.rfind(_PROBE_ANSWER)
        if not whole.startswith(prompt) or end < len(prompt):
            raise ValueError(
                "chat template: a user turn rendered with add_generation_prompt is not the "
                "start of the same turn followed by an assistant answer; mark the assistant's "
                "text with {% generation %} ... {% endgeneration %}"
            )
        return whole[end + len(_PROBE_ANSWER) :].rstrip()

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendering, the [start, end) characters of each assistant turn in it)."""
        if self.marked:
            return self._render_spans(messages)
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True) if i else ""
            if not text.startswith(prompt):
                raise ValueError(
                    f"chat template: message {i} (assistant): the conversation before it, "
                    f"rendered with its generation prompt, is not how the whole conversation "
                    f"begins; mark the assistant's text with {{% generation %}}"
                )
            content = str(message.get("content", "")).strip()
            found = text.find(content, len(prompt))
            if found < 0:
                raise ValueError(
                    f"chat template: message {i} (assistant): its content does not appear in "
                    f"the rendering; mark the assistant's text with {{% generation %}}"
                )
            end = found + len(content)
            if self._stop_text:
                stop = text.find(self._stop_text, end)
                if stop < 0 or text[end:stop].strip():
                    raise ValueError(
                        f"chat template: message {i} (assistant) is not closed by "
                        f"{self._stop_text!r} as its turns are; mark the assistant's text "
                        f"with {{% generation %}}"
                    )
                end = stop + len(self._stop_text)
            spans.append((len(prompt), end))
        return text, spans

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [n], assistant mask uint8 [n]) of a conversation."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return np.asarray(ids, np.int32), overlap_mask(offsets, spans)


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [n]: 1 for each token whose [start, end) characters overlap one of `spans`."""
    mask = np.zeros(len(offsets), np.uint8)
    if not offsets or not spans:
        return mask
    starts_N, ends_N = np.asarray(offsets, np.int64).T
    for start, end in spans:  # per assistant turn, vectorized over the tokens
        mask |= (ends_N > start) & (starts_N < end)
    return mask


def template_source(setting: str, tokenizer, culprit: str) -> str:
    """The template of `data.chat_template`=setting: the tokenizer's own (""), a built-in
    name, or a .jinja file; a one-line ValueError when there is none."""
    if setting in BUILT_IN:
        return BUILT_IN[setting]
    if setting:
        try:
            with open(setting, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"data.chat_template={setting!r}: cannot read it ({error})") from None
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise ValueError(
            f"data.format='chat': the tokenizer {culprit} has no chat template; name one "
            f"with --config.data.chat_template=chatml (the built-in ChatML) or =FILE.jinja"
        )
    return source


def check_messages(messages, where: str) -> list[dict]:
    """`messages` checked: a non-empty list of {role, content} objects with an assistant turn
    (keys whose value is null dropped, as transformers drops them)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {i} is not an object with a 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: message {i}: content is {type(content).__name__}, not text")
        out.append({k: v for k, v in message.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: the conversation has no assistant message to learn from")
    return out
