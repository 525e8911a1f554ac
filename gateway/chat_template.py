"""`--chat-template`: a Jinja chat template that replaces the model's own (vLLM's flag).

The value is a file path or the template itself. It is read and compiled when the gateway (or
`baton serve`) starts, so a typo in a path or a template syntax error stops the start with a
message, instead of turning every chat request into a 400.
"""

from __future__ import annotations

from pathlib import Path

# A value with any of these is a template, not a file name (vLLM decides the same way).
_TEMPLATE_CHARS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """The template text of a --chat-template value (a file's content, or the value itself)."""
    path = Path(value).expanduser()
    if not any(c in value for c in _TEMPLATE_CHARS):
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file (and not a Jinja template)")
        text = path.read_text(encoding="utf-8")
    else:
        text = value
    check_syntax(text)
    return text


def check_syntax(template: str) -> None:
    import jinja2
    from jinja2.ext import loopcontrols

    # transformers compiles chat templates with the loopcontrols extension ({% break %}).
    try:
        jinja2.Environment(extensions=[loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template: {exc} (line {exc.lineno})") from exc
