"""Chat examples rendered with the model's own chat template (tokenizer_config.json's
`chat_template`, a Jinja template), and which of their tokens the loss counts.

    template = chat.Template(text)                        # compiled once, sandboxed
    rendered, spans = template.assistant_spans(messages)  # the text, [(start, end)] of its characters
    ids, trained = chat.encode(template, messages, tok)   # tokens, and a mask of the assistant spans

Rendered as transformers renders it: a sandboxed Jinja environment (trim_blocks, lstrip_blocks,
loop controls), `messages`, `bos_token`, `eos_token` and `add_generation_prompt` in scope,
`raise_exception` and a `tojson` filter that does not escape HTML. The assistant spans are the
template's `{% generation %} ... {% endgeneration %}` blocks where it has them (what
transformers' return_assistant_tokens_mask marks); in a template without them, each assistant
message's span is what rendering the conversation up to it adds to rendering the conversation
before it with add_generation_prompt (trailing whitespace left out). The whole text is then
tokenized once (special tokens such as <|im_start|> kept whole) and a token is trained when
any of its characters lies in a span.
"""

from __future__ import annotations

import json

import numpy as np

from mpmd.recipes.config import ConfigError

# Private-use characters around each generation block while rendering; removed afterwards.
_OPEN, _CLOSE = "\ue000", "\ue001"


class Template:
    """A chat template compiled in a sandbox; ConfigError naming what is wrong with it."""

    def __init__(self, text: str, bos_token: str | None = None, eos_token: str | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(jinja2.ext.Extension):
            """{% generation %} ... {% endgeneration %}: its output between the two markers."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                return f"{_OPEN}{caller()}{_CLOSE}"

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"the tokenizer's chat_template does not compile: {e}") from None
        self.marked = "generation" in text and "endgeneration" in text
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages, add_generation_prompt: bool = False) -> str:
        """The template's text of `messages` (generation markers left in)."""
        import jinja2

        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._tokens
            )
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"the chat template refused the messages: {e}") from None

    def assistant_spans(self, messages) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans the loss counts: module doc)."""
        for m in messages:
            if _OPEN in m["content"] or _CLOSE in m["content"]:
                raise ConfigError("a message holds U+E000 or U+E001, which rendering uses as markers")
        if self.marked:
            return _unmark(self.render(messages))
        text = _unmark(self.render(messages))[0]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = _unmark(self.render(messages[:i], add_generation_prompt=True))[0]
            through = _unmark(self.render(messages[: i + 1]))[0]
            if not (through.startswith(before) and text.startswith(through)):
                raise ConfigError(
                    "the chat template renders a conversation's start differently from the whole "
                    "conversation, so its assistant turns cannot be found: give it {% generation %} blocks"
                )
            spans.append((len(before), len(through.rstrip())))
        return text, spans


def reply_prompt(template: Template, text: str) -> str:
    """A user message `text`, rendered for the assistant's reply (add_generation_prompt)."""
    return _unmark(template.render([{"role": "user", "content": text}], add_generation_prompt=True))[0]


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """(the text without generation markers, the spans they enclosed in it)."""
    text, spans, start = [], [], None
    at = 0
    for ch in marked:
        if ch == _OPEN:
            start = at
        elif ch == _CLOSE:
            spans.append((start, at))
        else:
            text.append(ch)
            at += 1
    return "".join(text), spans


def encode(template: Template, messages, tok) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n] int32, trained [n] bool) of a conversation rendered by `template` and
    tokenized by `tok` (a Hugging Face tokenizer) as one text, no special tokens added."""
    text, spans = template.assistant_spans(messages)
    ids, offsets = tok.encode_with_offsets(text)
    trained = np.zeros(len(ids), bool)
    for i, (s, e) in enumerate(offsets):
        trained[i] = any(s < end and e > start for start, end in spans)
    return np.asarray(ids, np.int32), trained
