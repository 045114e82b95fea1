"""A model folder's chat templates, read before any of them renders.

A chat template is code that comes with the model: transformers renders it in jinja's sandbox,
which refuses what leads out of it to Python's internals (`x.__class__`, `f.__globals__`, a
generator's frame). The sandbox answers such an attempt with a SecurityError at render time, and
only on the path the rendering takes. So every template of the folder is parsed first, and one
that names such an attribute anywhere is refused in one line naming its file, before a tokenizer
or model loads; an attempt the parse cannot see (a name built at render time) is refused where the
template renders (`sandbox_refusal`).

Where transformers reads templates from a folder: chat_template.jinja, additional_chat_templates/
*.jinja, and tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"}).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

from tunekit import TunekitError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Attributes jinja's sandbox refuses without a leading "__" (tunekit checks those by their prefix):
# a type's mro, the code and frame of functions, generators and coroutines, a frame's globals.
INTERNAL = frozenset({"mro", "gi_code", "gi_frame", "cr_code", "cr_frame", "ag_code", "ag_frame", "f_globals",
                      "f_locals", "f_builtins", "f_code", "tb_frame", "func_globals", "func_code"})
TODO = "replace it with the model's original chat template"


def template_sources(folder: Path) -> Iterator[tuple[str, str]]:
    """(where, source) of every chat template a tokenizer loaded from `folder` may render. Unreadable
    files are left to the tokenizer's own checks."""
    folder = Path(folder)
    files = [folder / TEMPLATE_FILE, *sorted((folder / TEMPLATE_DIR).glob("*.jinja"))]
    for f in files:
        try:
            yield str(f), f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    try:
        config = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    templates = config.get("chat_template") if isinstance(config, dict) else None
    where = f"{folder / TOKENIZER_CONFIG} (its chat_template)"
    if isinstance(templates, str):
        yield where, templates
    elif isinstance(templates, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        for t in templates:
            if isinstance(t, dict) and isinstance(t.get("template"), str):
                yield f"{folder / TOKENIZER_CONFIG} (its chat_template {t.get('name')!r})", t["template"]


def _parser():
    """A sandboxed environment that parses what transformers' own does: its {% generation %} block
    (the assistant-token mask) and loop controls. Used to parse only, never to render."""
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return ImmutableSandboxedEnvironment(extensions=[Generation, loopcontrols])


def _unsafe(name) -> bool:
    return isinstance(name, str) and (name.startswith("__") or name in INTERNAL)


def unsafe_access(source: str) -> list[tuple[str, int]]:
    """(attribute, line) of each attribute the sandbox would refuse that the template names, once
    each: `x.__class__`, `x['__class__']`, `x|attr('__class__')`. Raises jinja's TemplateSyntaxError
    for a template that does not parse."""
    from jinja2 import nodes

    found: dict[str, int] = {}
    for node in _parser().parse(source).find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, nodes.Const) else None
        else:
            name = node.args[0].value if node.name == "attr" and node.args and isinstance(node.args[0], nodes.Const) \
                else None
        if _unsafe(name):
            found[name] = min(found.get(name, node.lineno), node.lineno)
    return sorted(found.items(), key=lambda item: (item[1], source.find(item[0])))  # as the source reads


def check_chat_templates(folder: Path, key: str) -> None:
    """Every chat template of a model (or tokenizer) folder parses and names nothing jinja's sandbox
    refuses; else one TunekitError naming `key`, the file and the line."""
    from jinja2 import TemplateSyntaxError

    for where, source in template_sources(folder):
        try:
            found = unsafe_access(source)
        except TemplateSyntaxError as e:
            raise TunekitError(f"{key}: {where}: not a valid chat template (line {e.lineno}: {e.message}); "
                               f"{TODO}") from None
        if found:
            names = ", ".join(f"{name!r} (line {line})" for name, line in found[:3]) + (", ..." if len(found) > 3 else "")
            raise TunekitError(f"{key}: {where}: the chat template reaches {names}, which jinja's sandbox refuses "
                               f"(the way out of it to Python's internals); tunekit renders no such template: {TODO}")


def template_file(tokenizer) -> str:
    """Where the chat template of a loaded tokenizer came from, as best its folder says."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in (TEMPLATE_FILE, TOKENIZER_CONFIG):
        if (folder / name).is_file():
            return str(folder / name) + ("" if name == TEMPLATE_FILE else " (its chat_template)")
    return f"the chat template of {folder}" if str(folder) not in ("", ".") else "the tokenizer's chat template"


def sandbox_refusal(tokenizer, err: BaseException) -> Optional[TunekitError]:
    """The one-line error for a template the sandbox stopped while rendering (a SecurityError), or
    None for any other error (the caller reports those)."""
    from jinja2.exceptions import SecurityError

    if not isinstance(err, SecurityError):
        return None
    return TunekitError(f"{template_file(tokenizer)}: the chat template tried to reach what jinja's sandbox refuses "
                        f"({' '.join(str(err).split())[:160]}); the sandbox stopped it, nothing of it ran: {TODO}")
