"""Chat templates (data/chat_template.py) against transformers' `apply_chat_template`.

A tiny byte-level BPE tokenizer with the Qwen and Llama 3 control tokens is built here and
saved with each template in its tokenizer_config.json, as a Hugging Face checkpoint holds
it. The templates are the Qwen2-Instruct, Qwen3 and Llama-3-Instruct ones (their text is the
test data). jaxmoe's ids must equal transformers' token for token; the assistant mask must
equal one built by hand from the expected rendering, written out literally below with the
assistant's spans marked; with `{% generation %}` blocks, transformers' own
`return_assistant_tokens_mask`.
"""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jaxmoe.data.chat_template import ChatTemplate, template_source
from jaxmoe.data.hf_tokenizer import HFTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
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
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501
# Qwen2's template with the assistant's text marked, as TRL's training templates mark it.
QWEN2_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SYSTEM = {"role": "system", "content": "Be brief."}
TWO_TURNS = [
    {"role": "user", "content": "Hi, how are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
    {"role": "user", "content": "And the weather? Déjà vu."},
    {"role": "assistant", "content": " It is nice today.  "},
]
# The renderings written out: "[[...]]" marks what the assistant wrote.
EXPECTED = {
    "qwen2": (
        [*TWO_TURNS],
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi, how "
        "are you?<|im_end|>\n<|im_start|>assistant\n[[Fine, thanks.<|im_end|>]]\n<|im_start|>"
        "user\nAnd the weather? Déjà vu.<|im_end|>\n<|im_start|>assistant\n[[ It is nice today."
        "  <|im_end|>]]\n",
    ),
    "qwen3": (
        [SYSTEM, *TWO_TURNS],
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi, how are you?<|im_end|>"
        "\n<|im_start|>assistant\n[[Fine, thanks.<|im_end|>]]\n<|im_start|>user\nAnd the "
        "weather? Déjà vu.<|im_end|>\n<|im_start|>assistant\n[[<think>\n\n</think>\n\n It is "
        "nice today.  <|im_end|>]]\n",
    ),
    "llama3": (
        [SYSTEM, *TWO_TURNS],
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi, how are you?<|eot_id|><|start_header_"
        "id|>assistant<|end_header_id|>\n\n[[Fine, thanks.<|eot_id|>]]<|start_header_id|>user"
        "<|end_header_id|>\n\nAnd the weather? Déjà vu.<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n[[It is nice today.<|eot_id|>]]",
    ),
}
TEMPLATES = {"qwen2": QWEN2, "qwen3": QWEN3, "llama3": LLAMA3}
SPECIAL_MAPS = {
    "qwen2": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A byte-level BPE with the control tokens as added special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["Hi, how are you? Fine, thanks. And the weather is nice today. Be brief."] * 8
    tok.train_from_iterator(text, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_folder(tmp_path, tokenizer_json, name: str, template: str | None):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL_MAPS.get(name, {})}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def expected_mask(hf, marked: str) -> tuple[str, list[int]]:
    """The rendering without the [[ ]] marks, and the mask of the tokens overlapping them."""
    text, spans = "", []
    for piece in marked.split("[["):
        inside, _, after = piece.partition("]]") if "]]" in piece else ("", "", piece)
        if inside:
            spans.append((len(text), len(text) + len(inside)))
            text += inside
        text += after
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(end > s and start < e for s, e in spans))
        for start, end in encoded["offset_mapping"]
    ]
    return text, mask


@pytest.mark.parametrize("name", TEMPLATES)
def test_ids_and_mask_match_transformers_and_the_hand_built_mask(name, tokenizer_json, tmp_path):
    folder = hf_folder(tmp_path, tokenizer_json, name, TEMPLATES[name])
    hf = AutoTokenizer.from_pretrained(folder)
    ours = HFTokenizer(str(folder))
    template = ChatTemplate(template_source("", ours, "test"), ours)
    messages, marked = EXPECTED[name]
    text, want_mask = expected_mask(hf, marked)
    assert hf.apply_chat_template(messages, tokenize=False) == text  # the data is right
    ids, mask = template.encode(messages)
    assert list(ids) == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert list(mask) == want_mask
    assert sum(want_mask) > 0 and not all(want_mask)
    for conversation in ([TWO_TURNS[0], TWO_TURNS[1]], [SYSTEM, *TWO_TURNS[:2]]):
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert list(template.encode(conversation)[0]) == want


def test_generation_blocks_give_transformers_assistant_mask(tokenizer_json, tmp_path):
    folder = hf_folder(tmp_path, tokenizer_json, "marked", QWEN2_MARKED)
    hf = AutoTokenizer.from_pretrained(folder)
    ours = HFTokenizer(str(folder))
    template = ChatTemplate(ours.chat_template, ours)
    assert template.marked
    want = hf.apply_chat_template(TWO_TURNS, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = template.encode(TWO_TURNS)
    assert list(ids) == want["input_ids"] and list(mask) == want["assistant_masks"]
    assert sum(mask) > 0


def test_chat_template_file_and_builtin_chatml(tokenizer_json, tmp_path):
    """chat_template.jinja beside the tokenizer (transformers' newer layout) is read; a
    tokenizer without a template is refused in one line naming the key, or takes ChatML."""
    folder = hf_folder(tmp_path, tokenizer_json, "none", None)
    ours = HFTokenizer(str(folder))
    with pytest.raises(ValueError, match=r"has no chat template; name one with --config.data"):
        template_source("", ours, str(folder))
    chatml = ChatTemplate(template_source("chatml", ours, "x"), ours)
    text, spans = chatml.assistant_spans(TWO_TURNS[:2])
    assert text == (
        "<|im_start|>user\nHi, how are you?<|im_end|>\n<|im_start|>assistant\n"
        "Fine, thanks.<|im_end|>\n"
    )
    assert [text[s:e] for s, e in spans] == ["Fine, thanks.<|im_end|>"]
    (folder / "chat_template.jinja").write_text(LLAMA3)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL_MAPS["llama3"]})
    )
    hf = AutoTokenizer.from_pretrained(folder)
    ours = HFTokenizer(str(folder))
    ids = ChatTemplate(ours.chat_template, ours).encode(TWO_TURNS)[0]
    assert list(ids) == hf.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)


def test_template_errors_are_one_line(tokenizer_json, tmp_path):
    folder = hf_folder(tmp_path, tokenizer_json, "qwen2", QWEN2)
    ours = HFTokenizer(str(folder))
    raising = "{{ raise_exception('Only user and assistant roles are supported!') }}"
    with pytest.raises(ValueError, match=r"^chat template: .*Only user and assistant"):
        ChatTemplate(raising, ours)
    with pytest.raises(ValueError, match=r"^chat template, line 1: "):
        ChatTemplate("{% for m in messages %}", ours)
    # A template whose history is not a prefix of the next turn's prompt: refused, with the fix.
    shifting = QWEN2.replace("message['content']", "message['content'] + (loop.length|string)")
    with pytest.raises(ValueError, match=r"^chat template: .*\{% generation %\}"):
        ChatTemplate(shifting, ours)
    # ... also when only longer conversations show it (the history changes after a turn).
    late = QWEN2.replace(
        "message['content']", "message['content'] + ('!' if loop.length > 2 else '')"
    )
    with pytest.raises(ValueError, match=r"^chat template: message 1 \(assistant\).*generation"):
        ChatTemplate(late, ours).encode(TWO_TURNS)


def test_sentencepiece_takes_chatml_with_character_offsets(tmp_path):
    """A SentencePiece model (no template of its own) takes the built-in ChatML; its byte
    offsets are mapped back to characters, so non-ASCII text masks right."""
    import io

    import sentencepiece as spm

    from jaxmoe.data.tokenizer import Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["Déjà vu: the weather is nice today, thanks"] * 50),
        model_writer=model, vocab_size=284, minloglevel=2, byte_fallback=True,
    )  # fmt: skip
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    sp = Tokenizer(str(tmp_path / "tokenizer.model"))
    with pytest.raises(ValueError, match="has no chat template"):
        template_source("", sp, "tokenizer.model")
    template = ChatTemplate(template_source("chatml", sp, "x"), sp)
    messages = [{"role": "user", "content": "Déjà vu?"}, {"role": "assistant", "content": "Déjà!"}]
    text, _ = template.assistant_spans(messages)
    ids, mask = template.encode(messages)
    assert list(ids) == sp.encode(text)
    _, offsets = sp.encode_with_offsets(text)
    covered = "".join(text[s:e] for s, e in offsets)
    assert "".join(covered.split()) == "".join(text.split())  # whitespace: normalized away
    scored = sp.decode([int(i) for i, m in zip(ids, mask, strict=True) if m])
    assert "Déjà!<|im_end|>" in scored.replace(" ", "") and "vu" not in scored


def test_mask_ignores_tokens_outside_the_spans():
    from jaxmoe.data.chat_template import overlap_mask

    offsets = [(0, 2), (2, 5), (5, 5), (5, 9), (9, 12)]
    np.testing.assert_array_equal(overlap_mask(offsets, [(3, 9)]), [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(overlap_mask(offsets, []), [0, 0, 0, 0, 0])
